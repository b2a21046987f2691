"""A synthetic long-context attention workload that behaves like a real LLM decode head.

What real heads show, and what this generator builds in:
  * rotary position embedding (RoPE, Llama-3 base 500000, rotate-half layout) on keys and queries;
  * keys of low effective rank (a few latent directions carry most of the variance) with a few
    large-magnitude channels in low-frequency rotary pairs, as reported for trained models;
  * an attention sink at token 0 that every query attends to strongly;
  * "needles": short spans of tokens about one topic, scattered through the context; each query
    head attends to a couple of topics, so a handful of far-away tokens carry much of its mass;
  * everything else diffuse.

The needle and sink structure is placed after RoPE (the content a trained model learns to match
across positions); the latent noise and the large channels are placed before RoPE and rotated.
Generation runs on the CPU from one seed, so every device sees the same cache.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class WorkloadSpec:
    """Sizes and strengths of the synthetic cache (the demo's defaults)."""

    tokens: int = 16384  # prefill length N
    kv_heads: int = 8
    group: int = 4  # query heads per KV head (H = kv_heads * group)
    head_dim: int = 128
    steps: int = 8  # decode steps after the prefill
    batch: int = 1
    rope_base: float = 500000.0
    key_rank: int = 24  # latent directions of the key noise
    key_scale: float = 0.6  # per-channel std of the latent key noise
    large_channels: int = 4  # rotary pairs carrying a large offset
    large_magnitude: float = 6.0
    sink_logit: float = 10.0  # sink logit above the diffuse level
    topics: int = 32  # needle topics per KV head
    spans_per_topic: int = 3
    span_len: int = 4
    topics_per_query: int = 2
    needle_logit: float = 7.0
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("kv_heads", "group", "head_dim", "steps", "batch", "span_len"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name}: expected a positive integer, got {value!r}")
        if not isinstance(self.tokens, int) or self.tokens < self.span_len + 2:
            raise ValueError(
                f"tokens: expected an integer of at least span_len + 2 = {self.span_len + 2} "
                f"(room for a needle span after the first token), got {self.tokens!r}"
            )

    @property
    def num_heads(self) -> int:
        return self.kv_heads * self.group


@dataclass
class Workload:
    spec: object  # the generator's spec: WorkloadSpec, or pqattn.lab.needles.NeedleSpec
    keys: torch.Tensor  # [B, Hkv, tokens + steps, D]
    values: torch.Tensor  # [B, Hkv, tokens + steps, D]
    queries: torch.Tensor  # [steps, B, H, D]; step t's query sits at position tokens + t

    def to(self, device: torch.device | str, dtype: torch.dtype) -> Workload:
        return Workload(
            self.spec,
            self.keys.to(device=device, dtype=dtype),
            self.values.to(device=device, dtype=dtype),
            self.queries.to(device=device, dtype=dtype),
        )


def rope(x: torch.Tensor, positions: torch.Tensor, base: float) -> torch.Tensor:
    """Rotate-half RoPE: x [..., S, D] at positions [S] (pairs (i, i + D/2) rotate by pos * base**(-2i/D))."""
    D = x.shape[-1]
    inv_freq = base ** (-torch.arange(0, D, 2, dtype=torch.float64) / D)
    ang = positions.to(torch.float64)[:, None] * inv_freq[None, :]
    cos, sin = ang.cos().to(x.dtype), ang.sin().to(x.dtype)
    x1, x2 = x[..., : D // 2], x[..., D // 2 :]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def _unit(gen: torch.Generator, *shape: int) -> torch.Tensor:
    u = torch.randn(*shape, generator=gen)
    return u / u.norm(dim=-1, keepdim=True)


def make_workload(spec: WorkloadSpec = WorkloadSpec()) -> Workload:
    """Build keys, values and decode queries for `spec` (float32, CPU)."""
    s = spec
    gen = torch.Generator().manual_seed(s.seed)
    B, Hkv, g, D = s.batch, s.kv_heads, s.group, s.head_dim
    total = s.tokens + s.steps
    root_d = math.sqrt(D)
    pos = torch.arange(total)

    # Keys: low-rank latent noise plus large channels before RoPE, rotated, then sink and needles.
    basis = torch.randn(B, Hkv, s.key_rank, D, generator=gen) * (s.key_scale / math.sqrt(s.key_rank))
    keys = torch.randn(B, Hkv, total, s.key_rank, generator=gen) @ basis
    keys += 0.15 * torch.randn(B, Hkv, total, D, generator=gen)
    # Large channels sit in low-frequency rotary pairs, where RoPE barely turns them over the context.
    low = D // 8
    pairs = D // 2 - low + torch.randperm(low, generator=gen)[: s.large_channels]
    keys[..., pairs] += s.large_magnitude * (
        1 + 0.2 * torch.randn(B, Hkv, total, s.large_channels, generator=gen)
    )
    keys = rope(keys, pos, s.rope_base)

    sink_dir = _unit(gen, B, Hkv, D)
    sink_strength = math.sqrt(s.sink_logit * root_d)
    keys[:, :, 0] += sink_strength * sink_dir

    topic_dir = _unit(gen, B, Hkv, s.topics, D)
    needle_strength = math.sqrt(s.needle_logit * root_d)
    span_starts = torch.randint(
        1, s.tokens - s.span_len, (B, Hkv, s.topics, s.spans_per_topic), generator=gen
    )
    offsets = torch.arange(s.span_len)
    for b in range(B):
        for h in range(Hkv):
            for t in range(s.topics):
                where = (span_starts[b, h, t][:, None] + offsets).reshape(-1)
                jitter = 1 + 0.1 * torch.randn(where.numel(), 1, generator=gen)
                keys[b, h, where] += needle_strength * jitter * topic_dir[b, h, t]

    values = torch.randn(B, Hkv, total, D, generator=gen)

    # Queries: small latent part (rotated at the query's position) plus sink and topic directions.
    q_pos = torch.arange(s.tokens, total)
    q_lat = torch.randn(s.steps, B, Hkv * g, D, generator=gen) * 0.5
    queries = rope(q_lat.permute(1, 2, 0, 3), q_pos, s.rope_base).permute(2, 0, 1, 3).contiguous()
    kv_of_head = torch.arange(Hkv * g) // g
    queries += sink_strength * sink_dir[:, kv_of_head][None]
    chosen = torch.stack(
        [torch.randperm(s.topics, generator=gen)[: s.topics_per_query] for _ in range(s.steps * B * Hkv * g)]
    ).reshape(s.steps, B, Hkv * g, s.topics_per_query)
    tdir = topic_dir[:, kv_of_head]  # [B, H, topics, D]
    picked = torch.stack(
        [
            tdir[b][None]
            .expand(s.steps, -1, -1, -1)
            .gather(2, chosen[:, b, :, :, None].expand(-1, -1, -1, D))
            for b in range(B)
        ],
        dim=1,
    )
    queries += needle_strength * picked.sum(-2)
    return Workload(s, keys, values, queries)
