"""Baselines the suites time in the same run as pqattn: what a user would write without it."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pqattn.reference import pq as ref_pq


def sdpa_decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Dense decode attention through torch SDPA: q [B, H, D], k/v [B, Hkv, N, D] -> [B, H, D]."""
    return F.scaled_dot_product_attention(q[:, :, None], k, v, enable_gqa=True)[:, :, 0]


DENSE_DECODE = "pqattn-dense-decode"


def dense_decode_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """A transformers attention function, the dense loop that decodes as well as dense can here
    (FlashAttention's kv-cache decode is not installed): prefill through SDPA, a decode step over
    every cached token up to its position through pqattn's split-K kernel
    (`pqattn.integrations.hf.split_k_decode`, which pqattn's own dense fallbacks use).
    query [B, H, 1, D], key/value [B, Hkv, S, D] (a static cache: slots past the position unused)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from pqattn.integrations.hf import split_k_decode

    if query.shape[2] > 1:
        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, **kwargs)
    buffers = getattr(module, "_dense_decode_buffers", None)
    if buffers is None:
        buffers = module._dense_decode_buffers = {}
    return split_k_decode(query, key, value, kwargs.get("position_ids"), scaling, buffers), None


def register_dense_decode() -> str:
    """Register `dense_decode_attention` with transformers (SDPA's masks); returns its name. Under
    torch.compile it runs eagerly between the compiled graphs, as pqattn's attention does."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

    AttentionInterface.register(DENSE_DECODE, torch.compiler.disable(dense_decode_attention))
    ALL_MASK_ATTENTION_FUNCTIONS.register(DENSE_DECODE, sdpa_mask)
    return DENSE_DECODE


def sdpa_prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool) -> torch.Tensor:
    """Dense prefill attention through torch SDPA (bottom-right causal only when Sq == Sk)."""
    return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)


def kmeans_plain_torch(keys: torch.Tensor, *, subvectors: int, bits: int, iters: int, seed: int = 0):
    """The plain-torch k-means that issue 6 measures against: matmul distances, scatter-add updates.

    keys: [B, Hkv, N, D] -> (centroids [B, Hkv, M, C, dsub] float32, codes [B, Hkv, N, M] uint8).
    Init from data points (the reference's seeded stratified draw: no generator, so the baseline
    can be captured in a CUDA graph and timed like the kernel); an empty cluster keeps its previous
    centre; always `iters` rounds.
    """
    B, Hkv, N, D = keys.shape
    M, C = subvectors, 2**bits
    dsub = D // M
    x = keys.float().reshape(B, Hkv, N, M, dsub).permute(0, 1, 3, 2, 4).reshape(B * Hkv * M, N, dsub)
    G = x.shape[0]
    pick = ref_pq.init_positions(torch.full((G,), N, device=keys.device), C, seed)
    centroids = x.gather(1, pick[..., None].expand(G, C, dsub))
    x_sq = (x * x).sum(-1, keepdim=True)
    for _ in range(iters):
        dist = x_sq - 2.0 * torch.bmm(x, centroids.transpose(1, 2)) + (centroids * centroids).sum(-1)[:, None]
        assign = dist.argmin(dim=-1)
        sums = torch.zeros_like(centroids).scatter_add_(1, assign[..., None].expand(G, N, dsub), x)
        counts = torch.zeros(G, C, device=x.device).scatter_add_(1, assign, torch.ones_like(x[..., 0]))
        centroids = torch.where(counts[..., None] > 0, sums / counts.clamp_min(1)[..., None], centroids)
    codes = assign.to(torch.uint8).reshape(B, Hkv, M, N).permute(0, 1, 3, 2)
    return centroids.reshape(B, Hkv, M, C, dsub), codes
