"""The Triton index build (pqattn.kernels.kmeans) against the reference build (CPU interpreter; GPU).

Both start from the same centres for a seed, so the comparison is per iteration: objective,
centres, codes (up to float32 near-ties), iteration count and phi, against a float64 reference.
"""

from __future__ import annotations

import itertools
import warnings

import pytest
import torch
import triton

import pqattn
from pqattn.kernels import kmeans
from pqattn.kernels.kmeans import KMEANS_CONFIGS, build_pq
from pqattn.reference import pq as ref_pq
from tests.helpers import assert_close

CONFIG_IDS = [f"N{c.kwargs['BLOCK_N']}-w{c.num_warps}" for c in KMEANS_CONFIGS]
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def _keys(device, B, Hkv, N, D, dtype, lengths):
    keys = torch.randn(B, Hkv, N, D, device=device)
    keys[..., :3] *= 6.0  # a few large channels, like LLM keys
    keys = keys.to(dtype)
    for b, n in enumerate(lengths):
        keys[b, :, n:] = float("nan")  # past a sequence's length: never read
    return keys, torch.tensor(lengths, device=device)


def _near_tie(keys: torch.Tensor, lengths: torch.Tensor, kw: dict, rel: float = 2e-6) -> bool:
    """True when the float64 reference build of these keys decides an assignment or a reseed by a
    margin that float32 arithmetic may not resolve (relative to the squared norms involved).

    Such a near-tie sends a float32 build down another, equally valid path: codes flip, the next
    centres and objectives move by more than rounding. Only decisions that feed a centre update
    count (the last assignment's flips are allowed by the codes check); two equal centres are
    one choice (every implementation takes the lower index).
    """
    x64 = keys.nan_to_num().double()
    M, iters = kw["subvectors"], kw["iters"]
    x, valid = ref_pq._group_points(x64, lengths, M, kw.get("init_offset", 0))
    for it in range(iters):
        book = ref_pq.build_pq(x64, lengths, **{**kw, "iters": it})
        c = book.centroids.reshape(x.shape[0], -1, book.centroids.shape[-1])
        pts = x if book.phi is None else ref_pq.augment_ip(x, book.phi.reshape(-1))
        d = (pts * pts).sum(-1, keepdim=True) - 2 * pts @ c.transpose(1, 2) + (c * c).sum(-1)[:, None, :]
        scale = (pts * pts).sum(-1) + (c * c).sum(-1).amax(-1, keepdim=True)
        best, idx = d.min(-1)
        same = (c[:, None, :, :] == c.gather(1, idx[..., None].expand(-1, -1, c.shape[-1]))[:, :, None]).all(
            -1
        )
        second = d.masked_fill(same, float("inf")).amin(-1)
        if ((second - best < rel * scale) & valid).any():
            return True
        counts = d.new_zeros(c.shape[:2]).scatter_add_(1, idx, valid.double())
        empty = (counts == 0).sum(1) * (valid.sum(1) > 0)
        far = best.masked_fill(~valid, -1.0).sort(1, descending=True).values
        for g in range(x.shape[0]):  # the reseeds take the farthest points, by distance
            k = min(int(empty[g]) + 1, far.shape[1])
            if k > 1 and int(empty[g]) > 0 and (far[g, : k - 1] - far[g, 1:k] < rel * scale[g].max()).any():
                return True
    return False


def _clear_keys(device, B, Hkv, N, D, dtype, lengths, kw):
    """_keys, drawn again while the reference build has a near-tie (see _near_tie)."""
    for _ in range(20):
        keys, lens = _keys(device, B, Hkv, N, D, dtype, lengths)
        if not _near_tie(keys.cpu(), lens.cpu(), kw):
            return keys, lens
    raise AssertionError("20 draws in a row had a near-tie: the check is too strict for this shape")


def _assert_same_build(
    got: ref_pq.KMeansResult, want: ref_pq.KMeansResult, lengths, init_offset: int
) -> None:
    done = want.iterations
    assert isinstance(got.iterations, torch.Tensor) and got.iterations.device == got.codes.device
    assert int(got.iterations) == done
    assert got.codes.dtype == torch.uint8 and got.codes.shape == want.codes.shape
    # the GPU build keeps all iters + 1 rounds: after the last group stopped they repeat
    assert_close(
        got.objective[: done + 1], want.objective, atol=1e-3, rtol=1e-4, what="objective per iteration"
    )
    assert torch.equal(got.objective[done:], got.objective[done : done + 1].expand_as(got.objective[done:]))
    if want.phi is None:
        assert_close(got.centroids, want.centroids, atol=1e-4, rtol=1e-4, what="centroids")
    else:
        assert_close(got.phi, want.phi, atol=1e-5, rtol=1e-5, what="phi")
        assert_close(
            got.centroids[..., :-1], want.centroids[..., :-1], atol=1e-4, rtol=1e-4, what="centroids"
        )
        # The augmented coordinate sqrt(phi - |x|^2) of a point near the largest norm cancels: float32
        # sums of d squares leave phi - |x|^2 off by up to delta = 2 d ulp(phi), which sqrt turns into
        # up to sqrt(delta) (a point with phi - |x|^2 ~ 0). A centre's coordinate is a mean of those.
        d = want.centroids.shape[-1] - 1
        slack = (2 * d * 2.0**-24 * want.phi.double()).sqrt()[..., None]
        err = (got.centroids[..., -1].double() - want.centroids[..., -1]).abs()
        worst = (err - 1e-4 - 1e-4 * want.centroids[..., -1].abs() - slack).max()
        assert worst <= 0, f"augmented coordinate: off by {worst} beyond float32's cancellation bound"
    # float32 vs float64 distances may flip a near-tie; nothing else may differ
    assert (got.codes != want.codes).float().mean() <= 0.005
    for b, n in enumerate(lengths.tolist()):
        assert (got.codes[b, :, n:] == 0).all() and (got.codes[b, :, :init_offset] == 0).all()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("metric", ["euclidean", "ip"])
@pytest.mark.parametrize(
    "D, M, bits, N", [(32, 2, 3, 300), (66, 2, 4, 300), (16, 2, 8, 600)], ids=["d16-C8", "d33-C16", "d8-C256"]
)
def test_build_matches_the_reference(D: int, M: int, bits: int, N: int, metric: str, dtype, device) -> None:
    """Ragged batch, init_offset, NaN past the lengths. C=256 (~2 points per cluster) runs one
    iteration: after it, the two points of a cluster are exactly as far from its mean, a tie that
    float64 breaks by position and float32 rounding by chance, so the next reseed of an emptied
    cluster may rightly take the other point. Reseeds are checked by the tests below."""
    iters = 1 if bits == 8 else 4
    kw = dict(subvectors=M, bits=bits, metric=metric, init_offset=3, iters=iters, tol=0.0, seed=5)
    keys, lengths = _clear_keys(device, 2, 2, N, D, dtype, [N, N // 2 + 3], kw)
    got = build_pq(keys, lengths, **kw)
    want = ref_pq.build_pq(keys.nan_to_num().double(), lengths, **kw)
    _assert_same_build(got, want, lengths, 3)


def test_a_share_of_the_kv_heads_builds_as_the_whole_cache_does(device) -> None:
    """Heads 1..2 of a 4-head cache built alone with head_offset=1, total_heads=4 (a
    tensor-parallel rank's share) draw the whole build's initial centres for those heads: the
    kernel's init equals the reference's, and the reference's equals its whole-cache build."""
    kw = dict(subvectors=2, bits=3, metric="euclidean", init_offset=2, iters=0, tol=0.0, seed=7)
    keys, lengths = _clear_keys(device, 2, 4, 200, 16, torch.float32, [200, 150], kw)
    share = keys[:, 1:3].contiguous()
    whole = ref_pq.build_pq(keys.nan_to_num().double(), lengths, **kw)
    got = build_pq(share, lengths, **kw, head_offset=1, total_heads=4)
    want = ref_pq.build_pq(share.nan_to_num().double(), lengths, **kw, head_offset=1, total_heads=4)
    assert torch.equal(want.centroids, whole.centroids[:, 1:3])
    assert_close(got.centroids, want.centroids, atol=1e-5, rtol=1e-5, what="init centroids")
    alone = build_pq(share, lengths, **kw)  # seeded as heads 0..1: other picks
    assert not torch.equal(alone.centroids, got.centroids)


def test_a_build_whose_tiles_fit_no_config_runs_the_reference(monkeypatch, device) -> None:
    """When no step config fits the GPU's shared memory, build_pq says so and builds with the
    reference, in its own output contract (NaN past the lengths ignored, iters + 1 rounds)."""
    monkeypatch.setattr(kmeans, "_fit", lambda *args, **kwargs: None)
    kw = dict(subvectors=2, bits=4, metric="ip", init_offset=3, iters=4, tol=0.0, seed=5)
    keys, lengths = _clear_keys(device, 2, 2, 300, 32, torch.float32, [300, 153], kw)
    with pytest.warns(UserWarning, match="shared memory"):
        got = build_pq(keys, lengths, **kw)
    _assert_same_build(got, ref_pq.build_pq(keys.nan_to_num().double(), lengths, **kw), lengths, 3)


def test_the_fit_steps_down_from_the_config_to_16_point_blocks_then_the_other_warp_count() -> None:
    config = KMEANS_CONFIGS[0]
    tries = list(kmeans._step_downs(config, 256, 32, 3))
    first = kmeans._point_blocks(config.kwargs["BLOCK_N"], 256, 32, config.num_warps)
    assert tries[0] == (*first, config.num_warps, 3) and tries[1] == (*first, config.num_warps, 1)
    warps = [t[2] for t in tries]
    switch = warps.index(4)
    assert set(warps[:switch]) == {8} and set(warps[switch:]) == {4}
    for part in (tries[:switch], tries[switch:]):
        assert part[-1][:2] == (16, 16) and all(t[3] == 1 for t in part[1:])
        assert all(a[0] >= b[0] and a[1] >= b[1] for a, b in itertools.pairwise(part))


@pytest.mark.parametrize(
    "D, M, bits, dtype, fits",
    [(128, 1, 6, torch.float32, True), (256, 2, 7, torch.bfloat16, True), (256, 1, 8, torch.bfloat16, False)],
    ids=["d128-C64-fp32", "d128-C128-bf16", "d256-C256-bf16"],
)
def test_wide_subvectors_fit_the_shared_memory_or_run_the_reference(D, M, bits, dtype, fits, device) -> None:
    """Wide sub-vectors: the step's config steps down until its tiles fit the GPU's shared memory
    (no warning), or the build runs the reference (d = 256, C = 256 on an H100/H200)."""
    if device.type != "cuda":
        pytest.skip("shared memory limits are a GPU's")
    kw = dict(subvectors=M, bits=bits, init_offset=3, iters=3, tol=0.0, seed=4)
    keys, lengths = _clear_keys(device, 1, 2, 700, D, dtype, [650], kw)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = build_pq(keys, lengths, **kw)
    assert any("shared memory" in str(w.message) for w in caught) != fits
    _assert_same_build(got, ref_pq.build_pq(keys.nan_to_num().double(), lengths, **kw), lengths, 3)


def test_fewer_points_than_centres(device) -> None:
    """C=16 centres over 5 and 11 points: the init cycles through every point, so each point is
    a centre (objective 0) and every centre stays on a data point through the reseeds."""
    keys, lengths = _keys(device, 2, 1, 11, 8, torch.float32, [5, 11])
    got = build_pq(keys, lengths, subvectors=1, bits=4, iters=3, tol=0.0, seed=0)
    assert (got.objective <= 1e-6 * keys.nan_to_num().double().square().sum()).all()
    for b, n in enumerate(lengths.tolist()):
        pts, cents = keys[b, 0, :n].double(), got.centroids[b, 0, 0].double()
        assert (torch.cdist(cents, pts).min(1).values < 1e-5).all(), "a centre left the data"
        assert (got.codes[b, 0, n:] == 0).all()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("config", KMEANS_CONFIGS, ids=CONFIG_IDS)
def test_every_config(config: triton.Config, dtype, device) -> None:
    """Sub-vectors of 64 (D=128, M=2): the largest tiles, float32 ones included (shared memory)."""
    kw = dict(subvectors=2, bits=5, metric="ip", init_offset=1, iters=3, tol=0.0, seed=2)
    keys, lengths = _clear_keys(device, 2, 2, 700, 128, dtype, [700, 333], kw)
    got = build_pq(keys, lengths, **kw, config=config)
    want = ref_pq.build_pq(keys.nan_to_num().double(), lengths, **kw)
    _assert_same_build(got, want, lengths, 1)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(
    "D, M, bits", [(32, 4, 8), (64, 2, 4), (24, 3, 5)], ids=["d8-C256", "d32-C16", "d8-of-24-C32"]
)
def test_encode_keys_matches_the_reference_encode(D: int, M: int, bits: int, dtype, device) -> None:
    """The bulk encode of a sampled build: every key from init_offset against given centroids, 0
    past each length (NaN there never read), the rows before init_offset untouched; codes as the
    float64 reference's up to float32 near-ties. d = 8 of 24 pads its sub-vectors to 16."""
    B, Hkv, N, off = 2, 2, 700, 3
    keys, lengths = _keys(device, B, Hkv, N, D, dtype, [N, 257])
    C, d = 1 << bits, D // M
    centroids = torch.randn(B, Hkv, M, C, d, device=device) * 2.0
    codes = torch.full((B, Hkv, N, M), 255, dtype=torch.uint8, device=device)
    assert kmeans.encode_keys(keys, lengths, centroids, codes, init_offset=off)
    want = ref_pq.encode(keys[:, :, off:].nan_to_num().double(), centroids.double())
    got = codes[:, :, off:]
    for b, n in enumerate(lengths.tolist()):
        assert (got[b, :, : n - off] != want[b, :, : n - off]).float().mean() <= 0.005
        assert (got[b, :, n - off :] == 0).all()
    assert (codes[:, :, :off] == 255).all()


def test_encode_keys_checks_its_codes_buffer(device) -> None:
    keys, lengths = _keys(device, 1, 2, 50, 16, torch.float32, [50])
    cent = torch.randn(1, 2, 2, 8, 8, device=device)
    for bad in (
        torch.zeros(1, 2, 49, 2, dtype=torch.uint8, device=device),
        torch.zeros(1, 2, 50, 2, dtype=torch.int64, device=device),
        torch.zeros(1, 2, 2, 50, dtype=torch.uint8, device=device).transpose(2, 3),
    ):
        with pytest.raises(ValueError, match="codes"):
            kmeans.encode_keys(keys, lengths, cent, bad)


def test_encode_keys_refuses_tiles_that_fit_no_config(monkeypatch, device) -> None:
    monkeypatch.setattr(kmeans, "_fit", lambda *args, **kwargs: None)
    keys, lengths = _keys(device, 1, 2, 50, 16, torch.float32, [50])
    codes = torch.full((1, 2, 50, 2), 7, dtype=torch.uint8, device=device)
    assert not kmeans.encode_keys(keys, lengths, torch.randn(1, 2, 2, 8, 8, device=device), codes)
    assert (codes == 7).all()


@pytest.mark.parametrize("metric", ["euclidean", "ip"])
def test_empty_clusters_are_reseeded_like_the_reference(metric: str, device) -> None:
    """Centres far from every point get no point: each update moves them onto the farthest points."""
    keys, lengths = _keys(device, 1, 2, 200, 32, torch.float32, [200])
    C, d = 8, 16
    init = torch.randn(1, 2, 2, C, d + (metric == "ip"), device=device)
    init[..., 4:, :] += 100.0  # four centres nobody picks
    kw = dict(subvectors=2, bits=3, metric=metric, iters=3, tol=0.0, seed=0, init=init)
    got = build_pq(keys, lengths, **kw)
    want = ref_pq.build_pq(keys.double(), lengths, **{**kw, "init": init.double()})
    _assert_same_build(got, want, lengths, 0)
    assert (got.centroids.abs() < 50).all()
    assert (got.objective[1:] <= got.objective[:-1] * (1 + 1e-5)).all(), "the objective never rises"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("metric", ["euclidean", "ip"])
def test_a_point_as_near_to_two_centres_goes_to_the_lower_index(metric: str, dtype, device) -> None:
    """Duplicate centres (an init that drew equal points): their points all go to the lower index
    and the other centre, emptied, is reseeded, as in the reference. (A one-hot that marked every
    best centre, one comparison per pair, would count such points twice: this test failed for it.)"""
    C, d = 8, 16
    kw = dict(subvectors=2, bits=3, metric=metric, iters=3, tol=0.0, seed=0)
    for _ in range(20):  # _clear_keys with the init drawn too
        keys, lengths = _keys(device, 1, 2, 300, 32, dtype, [300])
        init = torch.randn(1, 2, 2, C, d + (metric == "ip"), device=device)
        init[..., 5, :] = init[..., 2, :]
        init[0, 1, 1, 7] = init[0, 1, 1, 0]  # one group with another pair
        if not _near_tie(keys.cpu(), lengths.cpu(), {**kw, "init": init.double().cpu()}):
            break
    else:
        raise AssertionError("20 draws in a row had a near-tie")
    kw["init"] = init
    got = build_pq(keys, lengths, **kw)
    want = ref_pq.build_pq(keys.double(), lengths, **{**kw, "init": init.double()})
    _assert_same_build(got, want, lengths, 0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("metric", ["euclidean", "ip"])
def test_a_cluster_of_one_point_equals_a_reseed_to_that_point(metric: str, dtype, device) -> None:
    """In every group one far point j is the only point of centre 1 and the farthest of all, so the
    first update gives centre 1 the mean of j and reseeds the empty centre 2 with j: two equal
    centres, and j goes to the lower index. float32 keys' tf32x3 sums took the mean an ulp off j,
    and j could go to centre 2: this test failed on the H200 for float32 keys at both metrics
    (the interpreter's products are exact), and so did 5% of the runs of the test above at the ip
    metric."""
    B, Hkv, M, N, dsub, j = 2, 2, 2, 64, 16, 37
    keys = torch.randn(B, Hkv, N, M * dsub, device=device)
    keys[:, :, j] += 8.0
    keys = keys.to(dtype)
    lengths = torch.full((B,), N, device=device)
    x = keys.double().reshape(B, Hkv, N, M, dsub).permute(0, 1, 3, 2, 4)  # [B, Hkv, M, N, dsub]
    init = torch.full((B, Hkv, M, 4, dsub), -100.0, dtype=torch.float64, device=device)
    init[:, :, :, 0] = 0.0
    init[:, :, :, 1] = x[:, :, :, j] + 3.0
    if metric == "ip":  # the points' augmented coordinate: 0 at j (the largest norm), ~8 sqrt(dsub) else
        norms = (x * x).sum(-1)
        aug = (norms.amax(-1, keepdim=True) - norms).sqrt()
        extra = torch.zeros(B, Hkv, M, 4, 1, dtype=torch.float64, device=device)
        extra[:, :, :, 0, 0] = aug.sum(-1) / (N - 1)
        init = torch.cat([init, extra], -1)
    kw = dict(subvectors=M, bits=2, metric=metric, iters=1, tol=0.0, seed=0)
    want = ref_pq.build_pq(keys.double(), lengths, **kw, init=init)
    tie = torch.equal(want.centroids[:, :, :, 1], want.centroids[:, :, :, 2])
    assert tie and (want.codes[:, :, j] == 1).all(), "the case must tie centres 1 and 2 at j"
    got = build_pq(keys, lengths, **kw, init=init.float())
    assert torch.equal(got.centroids[:, :, :, 1], got.centroids[:, :, :, 2]), "the mean of one point"
    assert (got.codes[:, :, j] == 1).all(), f"codes at j: {got.codes[:, :, j].flatten().tolist()}"
    kw["iters"] = 3
    _assert_same_build(
        build_pq(keys, lengths, **kw, init=init.float()),
        ref_pq.build_pq(keys.double(), lengths, **kw, init=init),
        lengths,
        0,
    )


def test_early_stop_freezes_each_group_like_the_reference(device) -> None:
    """Groups stop at different iterations (different sizes); a stopped group's centres, codes and
    objective stay as they were while the others go on."""
    keys, lengths = _keys(device, 3, 1, 400, 16, torch.float32, [400, 60, 12])
    kw = dict(subvectors=1, bits=2, iters=30, seed=1, tol=1.0)
    want = ref_pq.build_pq(keys.nan_to_num().double(), lengths, **kw)
    got = build_pq(keys, lengths, **kw)
    _assert_same_build(got, want, lengths, 0)
    frozen = (want.objective[-1] == want.objective[-2]).flatten()
    assert 0 < want.iterations < 30 and frozen.any(), "the case must stop some groups early"


def test_a_build_is_deterministic(device) -> None:
    keys, lengths = _keys(device, 1, 2, 1000, 64, torch.bfloat16, [1000])
    a = build_pq(keys, lengths, subvectors=2, bits=4, iters=3, tol=0.0, seed=3)
    b = build_pq(keys, lengths, subvectors=2, bits=4, iters=3, tol=0.0, seed=3)
    assert torch.equal(a.centroids, b.centroids) and torch.equal(a.codes, b.codes)


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


def test_a_build_is_captured_in_a_cuda_graph(device) -> None:
    """No host sync, no host-to-device copy: the whole build replays from a graph, same result."""
    if device.type != "cuda":
        pytest.skip("CUDA graphs")
    keys, lengths = _keys(device, 2, 2, 3000, 64, torch.bfloat16, [3000, 1777])
    kw = dict(subvectors=2, bits=6, metric="ip", init_offset=2, iters=5, tol=0.0, seed=9)
    eager = build_pq(keys, lengths, **kw)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        build_pq(keys, lengths, **kw)  # compiled and sized before the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = build_pq(keys, lengths, **kw)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured.codes, eager.codes) and torch.equal(captured.centroids, eager.centroids)
    assert int(captured.iterations) == int(eager.iterations) == 5
    # the public entry point, with no lengths to validate on the host, captures the same way
    public = pqattn.build_index(keys[:1, :, :2000], subvectors=2, bits=6, iters=3)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        book = pqattn.build_index(keys[:1, :, :2000], subvectors=2, bits=6, iters=3)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(book.codes, public.codes) and torch.equal(book.centroids, public.centroids)
