"""Weighted sparse decode attention (SPEC §3), dense attention (SPEC §4) and the paged cache
layout (SPEC §8), in plain PyTorch.

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


def paged_append(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    lengths: torch.Tensor,
    k_new: torch.Tensor,
    v_new: torch.Tensor,
) -> None:
    """Write each sequence's new key and value at its length through its block table (SPEC §8),
    in place: k_new, v_new [B, Hkv, D] into slot lengths[b] of caches [num_blocks, P, Hkv, D]."""
    P = k_cache.shape[1]
    at = lengths.long()
    block = block_table.long().gather(1, (at // P)[:, None])[:, 0]
    k_cache[block, at % P] = k_new.to(k_cache.dtype)
    v_cache[block, at % P] = v_new.to(v_cache.dtype)


def unpage(cache: torch.Tensor, block_table: torch.Tensor) -> torch.Tensor:
    """The contiguous view of a paged cache (SPEC §8): token i of sequence b lives in
    cache[block_table[b, i // P], i % P].

    cache: [num_blocks, P, Hkv, D]; block_table: [B, max_blocks] of block indices. Returns
    [B, Hkv, max_blocks * P, D] (a copy), token slots past a sequence's length included.
    """
    B, blocks = block_table.shape
    _, P, Hkv, D = cache.shape
    pages = cache.index_select(0, block_table.reshape(-1).long())  # [B * blocks, P, Hkv, D]
    return pages.reshape(B, blocks * P, Hkv, D).transpose(1, 2)


def to_pages(cache: torch.Tensor, block_table: torch.Tensor, num_blocks: int, page: int) -> torch.Tensor:
    """A contiguous cache [B, Hkv, N, D] laid out as a paged one (SPEC §8): [num_blocks, page, Hkv,
    D] with token i of sequence b in block block_table[b, i // page] (the inverse of `unpage`);
    slots past N and blocks the table does not name hold NaN, so that a read of one shows."""
    B, Hkv, N, D = cache.shape
    blocks = block_table.shape[1]
    if blocks * page < N:
        raise ValueError(f"block_table: {blocks} blocks of {page} tokens hold fewer than N={N} tokens")
    paged = torch.full((num_blocks, page, Hkv, D), float("nan"), dtype=cache.dtype, device=cache.device)
    padded = torch.full((B, Hkv, blocks * page, D), float("nan"), dtype=cache.dtype, device=cache.device)
    padded[:, :, :N] = cache
    paged[block_table.reshape(-1).long()] = padded.transpose(1, 2).reshape(-1, page, Hkv, D)
    return paged


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


def dense_decode(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    counts: torch.Tensor,
    *,
    starts: torch.Tensor | None = None,
    scale: float | None = None,
    return_lse: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Dense decode: out[b, h] = softmax(a) v over the first counts[b] tokens of the cache, that
    is `sparse_decode` over positions 0 .. counts[b] - 1; with starts, over starts[b] .. counts[b] - 1
    (a left-padded sequence's tokens).

    q: [B, H, D]; k, v: [B, Hkv, N, D]; counts: [B] in [0, N]; starts: [B] in [0, counts[b]] or None.
    Returns out [B, H, D] in q's dtype (and lse [B, H] when asked; a sequence with no tokens gives a
    zero row and lse -inf)."""
    B, H, _ = q.shape
    N = k.shape[2]
    first = torch.zeros(B, dtype=torch.long, device=q.device) if starts is None else starts.long()
    positions = (first[:, None] + torch.arange(N, device=q.device)).clamp_max(N - 1)[:, None].expand(B, H, N)
    taken = (counts.long() - first)[:, None].expand(B, H)
    return sparse_decode(q, k, v, positions, taken, scale=scale, return_lse=return_lse)


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
