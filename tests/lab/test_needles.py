"""The second synthetic generator: interleaved RoPE, single-token needles, no sink."""

from __future__ import annotations

import torch

from pqattn.lab import metrics
from pqattn.lab.needles import NeedleSpec, make_needles, rope_interleaved
from pqattn.lab.workload import rope


def test_interleaved_rope_rotates_adjacent_pairs() -> None:
    x = torch.randn(5, 8, dtype=torch.float64)
    pos = torch.arange(5)
    y = rope_interleaved(x, pos, 10000.0)
    assert torch.allclose(y.norm(dim=-1), x.norm(dim=-1))
    for i in range(4):  # pair (2i, 2i + 1) keeps its own norm: adjacent channels rotate together
        assert torch.allclose(y[:, 2 * i : 2 * i + 2].norm(dim=-1), x[:, 2 * i : 2 * i + 2].norm(dim=-1))
    # scores depend on relative positions only
    q, k = torch.randn(8, dtype=torch.float64), torch.randn(8, dtype=torch.float64)
    a = (
        rope_interleaved(q[None], torch.tensor([7]), 10000.0)
        @ rope_interleaved(k[None], torch.tensor([3]), 10000.0).T
    )
    b = (
        rope_interleaved(q[None], torch.tensor([14]), 10000.0)
        @ rope_interleaved(k[None], torch.tensor([10]), 10000.0).T
    )
    assert torch.allclose(a, b)
    assert not torch.allclose(y, rope(x, pos, 10000.0)), "not the rotate-half layout"


def test_needles_carry_the_mass_and_no_sink() -> None:
    spec = NeedleSpec(tokens=2048, kv_heads=2, group=2, head_dim=32, steps=3, needles=6, needles_per_query=2)
    w = make_needles(spec)
    assert w.keys.shape == (1, 2, 2051, 32) and w.queries.shape == (3, 1, 4, 32)
    assert torch.equal(w.keys, make_needles(spec).keys), "seeded"
    probs = torch.stack([metrics.attention_probs(q, w.keys) for q in w.queries])
    top = probs.topk(spec.needles_per_query, dim=-1).values.sum(-1)
    assert top.mean() > 0.5, "a query's few needle tokens carry much of its mass"
    assert top.min() < top.max() / 2, "heavy-tailed queries: some attend sharply, others diffusely"
    assert probs[..., 0].max() < 0.05, "no attention sink at token 0"
