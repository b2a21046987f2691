"""Quality of a selection against dense attention: captured mass, oracle recall, output error."""

from __future__ import annotations

import math

import torch

from pqattn.reference import Selection, dense_weights, exact_scores


def attention_probs(q: torch.Tensor, keys: torch.Tensor, scale: float | None = None) -> torch.Tensor:
    """Dense softmax probabilities [B, H, N] of q [B, H, D] over keys [B, Hkv, N, D] (float32/64)."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    return (exact_scores(q, keys) * scale).softmax(-1)


def selected_mask(selection: Selection, n_tokens: int) -> torch.Tensor:
    return dense_weights(selection, n_tokens, torch.float32) > 0


def captured_mass(probs: torch.Tensor, selection: Selection) -> torch.Tensor:
    """Share of the true attention mass on the selected tokens, per (b, h): [B, H]."""
    return (probs * selected_mask(selection, probs.shape[-1])).sum(-1)


def oracle_recall(
    selection: Selection, oracle: Selection, always_kept: Selection, n_tokens: int
) -> torch.Tensor:
    """|S ∩ O| / |O| per (b, h), O the oracle's heavy part (its selection minus sink and window).

    Rows whose oracle picks nothing beyond the always-kept tokens count as recall 1.
    """
    heavy = selected_mask(oracle, n_tokens) & ~selected_mask(always_kept, n_tokens)
    hits = (selected_mask(selection, n_tokens) & heavy).sum(-1)
    total = heavy.sum(-1)
    return torch.where(total > 0, hits / total.clamp_min(1), torch.ones_like(hits, dtype=torch.float32))


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| over the whole tensor, in float64."""
    out, ref = out.double(), ref.double()
    return float((out - ref).norm() / ref.norm().clamp_min(1e-300))
