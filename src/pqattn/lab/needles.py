"""A second synthetic decode workload, built unlike `pqattn.lab.workload` on purpose.

Quality figures from one generator say as much about the generator as about the selection; this
one changes every design choice of the first:

  * RoPE in the interleaved layout (GPT-J / GPT-NeoX-"interleaved": pairs (2i, 2i + 1)) with base
    10000, so that position moves keys much faster than at base 500000;
  * keys are isotropic noise with heavy-tailed per-channel scales (log-normal), no low-rank part
    and no attention sink;
  * needles are single tokens at uniformly random depths: each query head looks for a few of
    them, each far from the others, so one token (not a span) carries a large share of the mass;
  * queries are heavy-tailed (Student-t latent parts, log-normal norms), so some steps attend
    sharply and others diffusely.

The needles are placed after RoPE (matched content), the noise before it (rotated). Generation
runs on the CPU from one seed. The result is a `pqattn.lab.workload.Workload`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from pqattn.lab.workload import Workload


@dataclass(frozen=True)
class NeedleSpec:
    tokens: int = 16384
    kv_heads: int = 8
    group: int = 4
    head_dim: int = 128
    steps: int = 8
    batch: int = 1
    rope_base: float = 10000.0
    channel_spread: float = 0.7  # std of the log of the per-channel key scales
    needles: int = 16  # needle tokens per KV head
    needles_per_query: int = 3
    needle_logit: float = 9.0
    query_df: int = 3  # Student-t degrees of freedom of the query's latent part
    seed: int = 0

    @property
    def num_heads(self) -> int:
        return self.kv_heads * self.group


def rope_interleaved(x: torch.Tensor, positions: torch.Tensor, base: float) -> torch.Tensor:
    """Interleaved RoPE: x [..., S, D] at positions [S]; pair (2i, 2i + 1) turns by pos * base**(-2i/D)."""
    D = x.shape[-1]
    inv_freq = base ** (-torch.arange(0, D, 2, dtype=torch.float64) / D)
    ang = positions.to(torch.float64)[:, None] * inv_freq[None, :]
    cos, sin = ang.cos().to(x.dtype), ang.sin().to(x.dtype)
    even, odd = x[..., 0::2], x[..., 1::2]
    return torch.stack([even * cos - odd * sin, odd * cos + even * sin], dim=-1).flatten(-2)


def _student_t(gen: torch.Generator, df: int, *shape: int) -> torch.Tensor:
    """Student-t draws with `df` degrees of freedom, one scale per vector of the last axis."""
    chi2 = torch.randn(*shape[:-1], 1, df, generator=gen).pow(2).sum(-1)
    return torch.randn(*shape, generator=gen) / torch.sqrt(chi2 / df)


def make_needles(spec: NeedleSpec = NeedleSpec()) -> Workload:
    """Keys, values and decode queries for `spec` (float32, CPU)."""
    s = spec
    gen = torch.Generator().manual_seed(s.seed)
    B, Hkv, g, D = s.batch, s.kv_heads, s.group, s.head_dim
    H, total = Hkv * g, s.tokens + s.steps
    pos = torch.arange(total)
    scales = torch.exp(s.channel_spread * torch.randn(B, Hkv, 1, D, generator=gen))
    scales = scales / scales.pow(2).mean(-1, keepdim=True).sqrt()  # unit mean square per head
    keys = rope_interleaved(torch.randn(B, Hkv, total, D, generator=gen) * scales, pos, s.rope_base)

    strength = math.sqrt(s.needle_logit * math.sqrt(D))
    directions = torch.randn(B, Hkv, s.needles, D, generator=gen)
    directions /= directions.norm(dim=-1, keepdim=True)
    where = torch.stack([torch.randperm(s.tokens, generator=gen)[: s.needles] for _ in range(B * Hkv)])
    where = where.reshape(B, Hkv, s.needles)
    keys.scatter_add_(2, where[..., None].expand(-1, -1, -1, D), strength * directions)
    values = torch.randn(B, Hkv, total, D, generator=gen)

    q_pos = torch.arange(s.tokens, total)
    latent = _student_t(gen, s.query_df, s.steps, B, H, D) * 0.3
    queries = rope_interleaved(latent.permute(1, 2, 0, 3), q_pos, s.rope_base).permute(2, 0, 1, 3)
    # each query adds the directions of a few needles of its KV head, at a log-normal sharpness
    k = s.needles_per_query
    picks = torch.stack([torch.randperm(s.needles, generator=gen)[:k] for _ in range(s.steps * B * H)])
    picks = picks.reshape(s.steps, B, H, k).permute(1, 2, 0, 3).reshape(B, H, s.steps * k)
    dirs = directions[:, torch.arange(H) // g]  # [B, H, needles, D]
    chosen = dirs.gather(2, picks[..., None].expand(-1, -1, -1, D)).reshape(B, H, s.steps, k, D).sum(3)
    sharpness = torch.exp(0.5 * torch.randn(s.steps, B, H, 1, generator=gen))
    queries = queries + strength * sharpness * chosen.permute(2, 0, 1, 3)
    return Workload(s, keys, values, queries.contiguous())
