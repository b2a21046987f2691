"""The fused k-means step and the GPU Lloyd loop against the reference (CPU interpreter; GPU)."""

from __future__ import annotations

import pytest
import torch
import triton

import pqattn
from pqattn.kernels.kmeans import KMEANS_CONFIGS, kmeans_step, lloyd
from pqattn.reference import pq as ref_pq

CONFIG_IDS = [f"N{c.kwargs['BLOCK_N']}-w{c.num_warps}" for c in KMEANS_CONFIGS]


@pytest.mark.parametrize("config", KMEANS_CONFIGS, ids=CONFIG_IDS)
@pytest.mark.parametrize(
    "C, d", [(4, 8), (64, 16), (16, 33), (256, 32)], ids=["C4-d8", "C64-d16", "C16-d33", "C256-d32"]
)
def test_step_assigns_and_sums_like_the_reference(C: int, d: int, config: triton.Config, device) -> None:
    """Codes, distances and per-centre sums/counts of one step; ragged groups, padding not counted."""
    G, n, P = 3, 300, 2
    x = torch.randn(G, n, d, device=device)
    cent = torch.randn(G, C, d, device=device)
    n_valid = torch.tensor([300, 123, 0], dtype=torch.int32, device=device)
    CP, BD = max(C, 16), max(16, triton.next_power_of_2(d))
    codes = torch.empty(G, n, dtype=torch.int32, device=device)
    dist = torch.empty(G, n, device=device)
    sums = torch.empty(G, P, CP, BD, device=device)
    counts = torch.empty(G, P, CP, device=device)
    kmeans_step(x[:, None], 1, cent, n_valid, codes=codes, dist=dist, sums=sums, counts=counts, config=config)
    _, want_dist = ref_pq.assign(x.double(), cent.double())
    valid = torch.arange(n, device=device) < n_valid[:, None].long()
    # nearest centre of every valid point, up to float32 near-ties: the chosen one's distance is the minimum
    chosen = (
        ((x.double()[:, :, None] - cent.double()[:, None]) ** 2)
        .sum(-1)
        .gather(2, codes.long()[..., None])[..., 0]
    )
    # tolerances: the products run in tf32 on a GPU (10-bit mantissa inputs, float32 sums)
    assert torch.allclose(chosen[valid], want_dist[valid], rtol=5e-3, atol=1e-2)
    assert torch.allclose(dist.double()[valid], want_dist[valid], rtol=5e-3, atol=1e-2)
    want_sums, want_counts = ref_pq._segment_sums(x.double() * valid[..., None], codes.long(), valid, C)
    assert torch.equal(counts.sum(1)[:, :C].double(), want_counts)
    assert torch.allclose(sums.sum(1)[:, :C, :d].double(), want_sums, rtol=1e-3, atol=2e-2)
    assert (sums.sum(1)[:, C:] == 0).all() and (sums.sum(1)[:, :, d:] == 0).all()
    assert (codes[valid] < C).all()


@pytest.mark.parametrize("metric", ["euclidean", "ip"])
def test_build_matches_the_reference_objective(metric: str, device) -> None:
    """Same init: the final objective within 2% of the reference's (issue 6), every group."""
    keys = torch.randn(2, 2, 700, 32, device=device)
    lengths = torch.tensor([700, 450], device=device)
    kw = dict(subvectors=2, bits=4, metric=metric, init_offset=3, iters=8, tol=0.0, seed=5)
    want = ref_pq.build_pq(keys.double(), lengths, **kw)
    got = ref_pq.build_pq(keys, lengths, **kw, lloyd_impl=lloyd)
    assert got.iterations == want.iterations
    final, ref_final = got.objective[-1], want.objective[-1]
    assert ((final.double() - ref_final).abs() <= 0.02 * ref_final.abs() + 1e-6).all(), (final, ref_final)
    assert got.codes.shape == want.codes.shape and got.codes.dtype == torch.uint8
    assert (got.codes[1, :, 450:] == 0).all(), "codes past a sequence's length stay 0"


def test_empty_clusters_are_reseeded(device) -> None:
    """Centres far from every point get no point; the step reseeds them onto data (farthest first)."""
    x = torch.randn(1, 200, 16, device=device)
    init = torch.randn(1, 8, 16, device=device)
    init[0, 4:] += 100.0  # four centres nobody picks
    valid = torch.ones(1, 200, dtype=torch.bool, device=device)
    c, codes, history, done = lloyd(x, valid, init, iters=3, tol=0.0)
    assert done == 3 and (c.abs() < 50).all()
    assert (history[1:] <= history[:-1] * (1 + 1e-5)).all(), "the objective never rises"
    assert codes.unique().numel() == 8


def _quantization_error(keys: torch.Tensor, book) -> float:
    B, Hkv, N, D = keys.shape
    M, dsub = book.centroids.shape[2], D // book.centroids.shape[2]
    x = keys.float().reshape(B, Hkv, N, M, dsub).permute(0, 1, 3, 2, 4)  # [B, Hkv, M, N, dsub]
    idx = book.codes.long().permute(0, 1, 3, 2)[..., None].expand(-1, -1, -1, -1, dsub)
    return float(((x - book.centroids.float().gather(3, idx)) ** 2).sum())


def test_build_index_routes_cuda_to_the_kernel(device) -> None:
    """Issue 6's shape: the kernel build's quantization error within 2% of the reference build's."""
    if device.type != "cuda":
        pytest.skip("the kernel path is taken for CUDA tensors")
    keys = torch.randn(2, 8, 32768, 128, device=device, dtype=torch.bfloat16)
    lengths = torch.full((2,), 32768, device=device)
    kw = dict(subvectors=2, bits=6, iters=10, tol=0.0, seed=1)
    got = pqattn.build_index(keys, lengths, **kw)
    want = ref_pq.build_pq(keys, lengths, **kw)
    assert _quantization_error(keys, got) <= 1.02 * _quantization_error(keys, want)
