"""Weighted sparse decode attention (SPEC §3) and dense attention (SPEC §4), in plain PyTorch.

Both compute in float32 (float64 when q is float64) and return the output in q's dtype. A row
that attends to nothing (empty selection, or a causal row with no visible key) is a zero row
with log-sum-exp -inf, instead of the NaN a plain softmax would give.
"""

from __future__ import annotations

import math

import torch

from pqattn.reference.pq import compute_dtype


def _softmax_combine(logits: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """softmax(logits) @ values with -inf-only rows giving zeros: logits [..., S], values [..., S, D]."""
    if logits.shape[-1] == 0:  # (amax refuses an empty axis)
        m = logits.new_full((*logits.shape[:-1], 1), float("-inf"))
    else:
        m = logits.amax(-1, keepdim=True)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    p = torch.exp(logits - m)
    denom = p.sum(-1, keepdim=True)
    out = (p @ values) / denom.clamp_min(torch.finfo(denom.dtype).tiny)
    lse = (m + torch.log(denom)).squeeze(-1)  # log(0) = -inf for empty rows
    return out, lse


def sparse_decode(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    counts: torch.Tensor,
    weights: torch.Tensor | None = None,
    *,
    scale: float | None = None,
    return_lse: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """out[b, h] = sum_i w_i exp(a_i) v_i / sum_i w_i exp(a_i) over the selected set.

    q: [B, H, D]; k, v: [B, Hkv, N, D]; positions: [B, H, L] with the first counts[b, h] entries
    valid; weights: [B, H, L] per-entry weights > 0 (applied as the bias log w) or None.
    a_i = scale * <q[b, h], k[b, h // g, i]>, scale = 1/sqrt(D) by default.
    Returns out [B, H, D] in q's dtype (and lse [B, H] float32/64 when asked).
    """
    B, H, D = q.shape
    Hkv, N = k.shape[1], k.shape[2]
    L = positions.shape[-1]
    dt = compute_dtype(q.dtype)
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    valid = torch.arange(L, device=q.device) < counts[..., None].long()
    kvh = torch.arange(H, device=q.device) // (H // Hkv)
    rows = (torch.arange(B, device=q.device)[:, None] * Hkv + kvh[None, :]) * N  # [B, H]
    flat = (rows[..., None] + positions.long().clamp_min(0) * valid).reshape(-1)
    kk = k.reshape(-1, D).index_select(0, flat).reshape(B, H, L, D).to(dt)
    vv = v.reshape(-1, D).index_select(0, flat).reshape(B, H, L, D).to(dt)
    logits = torch.einsum("bhd,bhld->bhl", q.to(dt), kk) * scale
    if weights is not None:
        logits = logits + torch.log(weights.to(dt))
    logits = logits.masked_fill(~valid, float("-inf"))
    out, lse = _softmax_combine(logits[..., None, :], vv)
    out = out.squeeze(-2).to(q.dtype)
    return (out, lse.squeeze(-1)) if return_lse else out


def dense_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = False,
    scale: float | None = None,
    return_lse: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention: q [B, H, Sq, D], k/v [B, Hkv, Sk, D] -> out [B, H, Sq, D] (lse [B, H, Sq]).

    causal: query i sees keys j <= i + (Sk - Sq) (queries aligned to the end of the keys).
    """
    H, Sq, D = q.shape[1:]
    Hkv, Sk = k.shape[1], k.shape[2]
    dt = compute_dtype(q.dtype)
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    kvh = torch.arange(H, device=q.device) // (H // Hkv)
    kk, vv = k[:, kvh].to(dt), v[:, kvh].to(dt)
    logits = (q.to(dt) @ kk.transpose(-1, -2)) * scale
    if causal:
        i = torch.arange(Sq, device=q.device)[:, None]
        j = torch.arange(Sk, device=q.device)[None, :]
        logits = logits.masked_fill(j > i + (Sk - Sq), float("-inf"))
    out, lse = _softmax_combine(logits, vv)
    out = out.to(q.dtype)
    return (out, lse) if return_lse else out
