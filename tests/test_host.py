"""`HostCache`, the host tier (SPEC §10): the same selection and output as the on-GPU PQIndex path,
its memory checks and its refusals."""

from __future__ import annotations

import pytest
import torch

import pqattn
from pqattn import host
from pqattn import reference as ref
from pqattn.host import HostCache


def _pair(
    device, *, B=2, H=8, Hkv=2, D=32, steps=6, slots=None, dtype=torch.float32, int8=False, metric="euclidean"
):
    """A HostCache and an on-GPU PQIndex with its caches, over the same ragged prompts (one
    deterministic build each)."""
    N = 160 if device.type == "cpu" else 2000
    config = pqattn.PQConfig(subvectors=4, bits=4, sink=4, window=8, heavy=8, iters=3, metric=metric)
    keys = torch.randn(B, Hkv, N + steps, D, device=device, dtype=dtype)
    values = torch.randn(B, Hkv, N + steps, D, device=device, dtype=dtype)
    lengths = [N, N - 37]
    cache = HostCache.prefill(
        keys[:, :, :N],
        values[:, :, :N],
        lengths,
        query_heads=H,
        capacity=N + steps,
        config=config,
        slots=slots,
        int8=int8,
    )
    index = pqattn.PQIndex.build(keys[:, :, :N], lengths, capacity=N + steps, config=config)
    return cache, index, keys.clone(), values.clone(), lengths


def _take_routes(routes: str, device: torch.device, request) -> None:
    """`routes`: "kernels" runs the Triton kernels (under the interpreter on a CPU); "reference"
    the PyTorch rules, which a CUDA machine does not take for the host tier (skipped there)."""
    if routes == "kernels":
        request.getfixturevalue("kernel_routes")
    elif device.type == "cuda":
        pytest.skip("the host tier takes its kernels on CUDA")


def _matches_the_gpu_step(got, cache, index, q, k_new, v_new, k_cache, v_cache) -> None:
    """Run the on-GPU path's step on the same inputs: the same lengths, the same selection (as
    multisets of the group's PQ scores: the kernels break ties at the threshold in any order, and
    the lists' order is not fixed), and `got` equal to the on-GPU attention over the lists the
    host tier's step attended over."""
    index.decode_step(q, k_new, v_new, k_cache, v_cache)
    assert torch.equal(cache.index.lengths, index.lengths)
    mine, theirs = cache.selection, index.select(q)
    assert torch.equal(mine.counts, theirs.counts)
    c = index.config
    scores = ref.group_pq_scores(q.double(), index.centroids.double(), index.codes, c.group_rule)
    for b, h in ((b, h) for b in range(scores.shape[0]) for h in range(scores.shape[1])):
        picked = [sel.positions[b, h, : int(sel.counts[b, h])].long() for sel in (mine, theirs)]
        assert len(set(picked[0].tolist())) == picked[0].numel(), "distinct positions"
        torch.testing.assert_close(*(scores[b, h, p].sort().values for p in picked), rtol=0, atol=1e-5)
    want = index.attend(q, k_cache, v_cache, pqattn.Selection(mine.positions.clone(), mine.counts.clone()))
    assert torch.equal(got, want)


@pytest.mark.parametrize(
    "routes,metric", [("reference", "euclidean"), ("kernels", "euclidean"), ("kernels", "ip")]
)
def test_host_tier_decodes_as_the_gpu_cache_does(
    routes: str, metric: str, device: torch.device, request
) -> None:
    """Ragged GQA batch, steps whose selections overlap: the host tier selects the on-GPU path's
    tokens (sets: the kernels' list order is not fixed), its output equals the on-GPU attention
    over its own lists, rows missed are fetched (the hit rate is neither 0 nor 1), and the host
    rows hold each step's new key and value."""
    _take_routes(routes, device, request)
    B, H, Hkv, D, steps = 2, 8, 2, 32, 6
    cache, index, k_cache, v_cache, lengths = _pair(device, steps=steps, metric=metric)
    for t in range(steps):
        q = torch.randn(B, H, D, device=device)
        k_new, v_new = (torch.randn(B, Hkv, 1, D, device=device) for _ in range(2))
        got = cache.decode_step(q, k_new, v_new).clone()
        _matches_the_gpu_step(got, cache, index, q, k_new, v_new, k_cache, v_cache)
        for b, n in enumerate(lengths):
            assert torch.equal(cache.rows[b, :, n + t, 0], k_new[b, :, 0].cpu())
            assert torch.equal(cache.rows[b, :, n + t, 1], v_new[b, :, 0].cpu())
    assert 0.0 < cache.hit_rate() < 1.0


@pytest.mark.parametrize("routes", ["reference", "kernels"])
def test_the_8_bit_host_tier_attends_over_the_dequantized_rows(
    routes: str, device: torch.device, request
) -> None:
    """int8 rows: each step's output is the on-GPU attention, over the same lists, of the caches
    as they come back from 8 bits (the new rows too), and close to the attention over the same
    lists of the unquantized caches (the same lists: ties at the threshold break in any order)."""
    _take_routes(routes, device, request)
    B, H, Hkv, D, steps = 2, 8, 2, 32, 4
    cache, index, k_cache, v_cache, _ = _pair(device, steps=steps, int8=True)
    assert cache.rows.dtype == torch.uint8 and cache.rows.shape[-1] == 2 * D + 8
    deq = [ref.decode_rows(ref.encode_rows(k_cache, v_cache, torch.uint8), D)[i].clone() for i in (0, 1)]
    for _ in range(steps):
        q = torch.randn(B, H, D, device=device)
        k_new, v_new = (torch.randn(B, Hkv, 1, D, device=device) for _ in range(2))
        got = cache.decode_step(q, k_new, v_new).clone()
        index.decode_step(q, k_new, v_new, k_cache, v_cache)  # stores the new rows, as the tier does
        new = ref.decode_rows(ref.encode_rows(k_new, v_new, torch.uint8), D)
        at = (index.lengths - 1).view(B, 1, 1, 1).long().expand(B, Hkv, 1, D)
        for plane, row in zip(deq, new, strict=True):
            plane.scatter_(2, at, row)
        mine = cache.selection
        lists = pqattn.Selection(mine.positions.clone(), mine.counts.clone())
        want = index.attend(q, *deq, lists)
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
        exact = index.attend(q, k_cache, v_cache, lists)
        assert (got - exact).norm() < 0.03 * exact.norm()


def test_host_tier_in_a_cuda_graph(device: torch.device) -> None:
    """The whole step captured once and replayed per token (fetches from mapped host memory)."""
    if device.type != "cuda":
        pytest.skip("CUDA graphs need a GPU")
    B, H, Hkv, D, steps = 2, 8, 2, 32, 5
    cache, index, k_cache, v_cache, _ = _pair(device, steps=steps + 1, dtype=torch.bfloat16)
    q = torch.randn(B, H, D, device=device, dtype=torch.bfloat16)
    k_new, v_new = (torch.randn(B, Hkv, 1, D, device=device, dtype=torch.bfloat16) for _ in range(2))
    cache.decode_step(q, k_new, v_new)
    index.decode_step(q, k_new, v_new, k_cache, v_cache)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = cache.decode_step(q, k_new, v_new)
    for _ in range(steps):
        for t in (q, k_new, v_new):
            t.normal_()
        graph.replay()
        _matches_the_gpu_step(out, cache, index, q, k_new, v_new, k_cache, v_cache)
    assert 0.0 < cache.hit_rate() < 1.0


def test_host_tier_refuses_what_it_cannot_serve(device: torch.device, monkeypatch) -> None:
    keys = torch.randn(1, 2, 64, 16, device=device)
    head = pqattn.PQConfig(subvectors=4, bits=4, sink=4, window=4, heavy=8, iters=1, share="head")
    with pytest.raises(ValueError, match="share: expected 'group'"):
        HostCache.prefill(keys, keys, query_heads=4, config=head)
    group = pqattn.PQConfig(subvectors=4, bits=4, sink=4, window=4, heavy=8, iters=1)
    with pytest.raises(ValueError, match="slots: expected at least the list width 24, got 23"):
        HostCache.prefill(keys, keys, query_heads=4, config=group, slots=23)
    with pytest.raises(ValueError, match="query_heads"):
        HostCache.prefill(keys, keys, query_heads=3, config=group)
    with pytest.raises(ValueError, match="values"):
        HostCache.prefill(keys, keys[:, :, :10], query_heads=4, config=group)
    monkeypatch.setattr(host, "available_host_bytes", lambda: 1000)
    with pytest.raises(
        ValueError,
        match="capacity: the host tier needs 16384 bytes of page-locked host memory, the machine has 1000 ",
    ):
        HostCache.prefill(keys, keys, query_heads=4, config=group)
    cache = HostCache(
        pqattn.PQIndex.build(keys, config=group),
        query_heads=4,
        dtype=keys.dtype,
        rows=torch.zeros(1, 2, 64, 2, 16),
    )  # given rows are not checked against the memory
    with pytest.raises(ValueError, match=r"q: expected shape \[B, H, D\] = \[1, 4, 16\]"):
        cache.decode_step(torch.randn(1, 2, 16, device=device), keys[:, :, :1], keys[:, :, :1])
    with pytest.raises(ValueError, match="scale: expected a finite float or None, got nan"):
        cache.decode_step(
            torch.randn(1, 4, 16, device=device), keys[:, :, :1], keys[:, :, :1], scale=float("nan")
        )
    assert cache.index.lengths.tolist() == [64], "nothing appended"


def test_footprint_counts_what_a_tier_allocates(device: torch.device) -> None:
    """The footprint, computed before allocation, covers the host rows exactly and the GPU tensors
    the tier holds (index and row cache) within their small lists."""
    keys = torch.randn(2, 2, 100, 16, device=device)
    config = pqattn.PQConfig(subvectors=4, bits=4, sink=4, window=4, heavy=8, iters=1)
    cache = HostCache.prefill(keys, keys, query_heads=4, capacity=120, config=config)
    want = host.footprint(
        config, batch=2, query_heads=4, kv_heads=2, head_dim=16, capacity=120, dtype=keys.dtype
    )
    assert want == cache.footprint
    assert cache.slots == 120, "the default slots (8 list widths of 24) stop at the capacity"
    assert want.host == cache.rows.numel() * cache.rows.element_size()
    tensors = [cache.index.codes, cache.index.centroids, cache.k_slots, cache.v_slots, *cache.row_cache]
    held = sum(t.numel() * t.element_size() for t in tensors)
    assert held <= want.gpu <= held * 1.1


def test_truncate_keeps_the_rows_before_and_forgets_the_rest(device: torch.device) -> None:
    """After a roll-back, the positions past the new lengths are written again: the row cache must
    not serve their old rows (the steps after it still equal the on-GPU path), while the rows
    before stay resident."""
    if device.type == "cuda":
        pytest.skip("the CPU reference route is enough: truncate is PyTorch on the row cache")
    B, H, Hkv, D, steps = 2, 8, 2, 32, 6
    cache, index, k_cache, v_cache, lengths = _pair(device, steps=steps)
    for t in range(steps):
        if t == 3:  # roll back two tokens and decode new ones at those positions
            back = [n + 1 for n in lengths]
            cache.truncate(back)
            index.truncate(back)
            resident = cache.row_cache.owner
            assert bool((resident < torch.tensor(back).view(B, 1, 1)).all())
            assert bool((resident >= 0).any())
        q = torch.randn(B, H, D, device=device)
        k_new, v_new = (torch.randn(B, Hkv, 1, D, device=device) for _ in range(2))
        got = cache.decode_step(q, k_new, v_new).clone()
        _matches_the_gpu_step(got, cache, index, q, k_new, v_new, k_cache, v_cache)
