"""The sparse decode kernel against the reference: every config, named cases, the GPU at full shapes.

Runs under the Triton interpreter on a CPU (small shapes) and compiled on a GPU. The random fuzz
over all configs is `pqattn check` (tests/lab/test_check.py runs it too).
"""

from __future__ import annotations

import math

import pytest
import torch
import triton

import pqattn
from pqattn import reference as ref
from pqattn.kernels import decode
from pqattn.kernels.decode import (
    DECODE_CONFIGS,
    DENSE_DECODE_CONFIGS,
    DENSE_WIDE_CONFIGS,
    GROUP_DECODE_CONFIGS,
    group_decode,
    group_workspace_numel,
    sparse_decode,
)
from pqattn.lab.kernel_checks import compare_decode, draw_decode, reference_decode, run_decode

CONFIG_IDS = [f"L{c.kwargs['BLOCK_L']}-N{c.kwargs['BLOCK_N']}-w{c.num_warps}" for c in DECODE_CONFIGS]


def _case(device, *, B, H, Hkv, N, L, D, dtype, counts, weights=None, dense=False, scale=None) -> dict:
    counts = torch.tensor(counts, dtype=torch.int32).reshape(B, H)
    positions = torch.rand(B, H, N).argsort(-1)[..., :L]
    positions = torch.where(torch.arange(L) < counts[..., None], positions, -1)
    return {
        "q": torch.randn(B, H, D).to(dtype).to(device),
        "k": (3 * torch.randn(B, Hkv, N, D)).to(dtype).to(device),
        "v": torch.randn(B, Hkv, N, D).to(dtype).to(device),
        "positions": positions.to(torch.int32).to(device),
        "counts": counts.to(device),
        "weights": None if weights is None else weights.to(device),
        "dense": dense,
        "scale": scale,
    }


def _check(case: dict, config: triton.Config) -> None:
    cfg = {**config.kwargs, "num_warps": config.num_warps}
    problem = compare_decode(case, run_decode(case, cfg), reference_decode(case))
    assert problem is None, problem


@pytest.mark.parametrize("config", DECODE_CONFIGS, ids=CONFIG_IDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_ragged_gqa_splits(config: triton.Config, dtype: torch.dtype, device: torch.device) -> None:
    """Counts of 0, 1, one split, several splits and the full width; GQA 4; -1 padding."""
    L = 3 * config.kwargs["BLOCK_L"] + 5
    counts = [0, 1, config.kwargs["BLOCK_L"], L, L - 7, 2 * config.kwargs["BLOCK_L"] + 1, 3, 0]
    _check(_case(device, B=2, H=4, Hkv=1, N=L + 40, L=L, D=32, dtype=dtype, counts=counts), config)


def test_the_bfloat16_tolerance_grows_with_the_output() -> None:
    """A bfloat16 output may differ by atol + rtol * |expected| (its rounding is relative), and
    no more: the check still flags an error past it."""
    case = {"q": torch.zeros(1, 1, 4, dtype=torch.bfloat16)}
    exp, lse = torch.tensor([[[0.1, 3.0, -3.0, 0.0]]], dtype=torch.float64), torch.zeros(1, 1)
    near = exp + torch.tensor([0.019, 0.06, -0.06, 0.0], dtype=torch.float64)
    assert compare_decode(case, (near.to(torch.bfloat16), lse), (exp, lse)) is None
    far = exp + torch.tensor([0.0, 0.1, 0.0, 0.03], dtype=torch.float64)
    assert "output differs" in compare_decode(case, (far.to(torch.bfloat16), lse), (exp, lse))


@pytest.mark.parametrize("config", DECODE_CONFIGS, ids=CONFIG_IDS)
def test_weights_entry_and_dense(config: triton.Config, device: torch.device) -> None:
    B, H, L = 1, 2, 2 * config.kwargs["BLOCK_L"] + 3
    N = L + 40
    entry = torch.rand(B, H, L) + 0.1
    _check(
        _case(device, B=B, H=H, Hkv=2, N=N, L=L, D=64, dtype=torch.float32, counts=[L, 17], weights=entry),
        config,
    )
    dense = (torch.rand(B, H, N) + 0.1) * (torch.rand(B, H, N) > 0.3)  # weight 0 drops a token
    dense[0, 1] = 0.0  # every token of a row dropped: a zero row, lse -inf
    case = _case(
        device, B=B, H=H, Hkv=1, N=N, L=L, D=16, dtype=torch.float16, counts=[L, L], weights=dense, dense=True
    )
    _check({**case, "scale": 0.3}, config)


@pytest.mark.parametrize("unroll", [None, (1, 1), (1, 2)], ids=["unrolled", "loop-1", "loop-2"])
def test_more_splits_than_one_combine_step(unroll, device: torch.device, monkeypatch) -> None:
    """Over 16 splits: the last program merges the partials in several steps (online maxima); one
    row's count ends inside the first step, one inside the second. Also with the steps in a loop
    (a list wider than the unroll cap), over blocks of one and of two steps, the last block past
    the splits."""
    if unroll is not None:
        monkeypatch.setattr(decode, "_UNROLL_MAX", unroll[0])
        monkeypatch.setattr(decode, "_UNROLL_BLOCK", unroll[1])
    config = DECODE_CONFIGS[0]
    L = 17 * config.kwargs["BLOCK_L"] + 9
    counts = [L, 40, L - 20, 0]
    _check(_case(device, B=1, H=4, Hkv=2, N=L + 10, L=L, D=16, dtype=torch.float16, counts=counts), config)


@pytest.mark.parametrize("config", DECODE_CONFIGS, ids=CONFIG_IDS)
def test_entries_past_the_count_are_never_read(config: triton.Config, device: torch.device) -> None:
    """Past its count a list may hold anything (the kernel requests the first positions before the
    count arrives): entries far out of the cache must not be gathered; a list of width 0 gives
    zero rows."""
    L = 2 * config.kwargs["BLOCK_L"] + 3
    case = _case(device, B=1, H=4, Hkv=2, N=L + 8, L=L, D=32, dtype=torch.float16, counts=[L, 1, 0, L - 9])
    cnt = case["counts"][..., None].long()
    case["positions"] = torch.where(torch.arange(L, device=device) < cnt, case["positions"], 1 << 30)
    _check(case, config)
    empty = _case(device, B=1, H=2, Hkv=1, N=8, L=0, D=32, dtype=torch.float16, counts=[0, 0])
    _check(empty, config)


def test_single_split_and_one_token(device: torch.device) -> None:
    """One selected token: the output is its value row exactly (up to the dtype's rounding)."""
    case = _case(device, B=1, H=1, Hkv=1, N=10, L=1, D=32, dtype=torch.float32, counts=[1])
    out, lse = run_decode(case, {**DECODE_CONFIGS[0].kwargs, "num_warps": DECODE_CONFIGS[0].num_warps})
    p = int(case["positions"][0, 0, 0])
    torch.testing.assert_close(out[0, 0], case["v"][0, 0, p], atol=1e-6, rtol=1e-6)
    logit = float((case["q"][0, 0] * case["k"][0, 0, p]).sum()) / math.sqrt(32)
    assert abs(float(lse[0, 0]) - logit) < 1e-4


def test_ops_route_and_preallocated_buffers(device: torch.device, kernel_routes) -> None:
    """ops.sparse_decode on the kernel route (compiled on a GPU, interpreted on a CPU) into the
    given out/workspace, against the reference."""
    case = _case(device, B=2, H=8, Hkv=2, N=500, L=96, D=64, dtype=torch.bfloat16, counts=[96] * 8 + [50] * 8)
    want = reference_decode(case)[0]
    out = torch.empty_like(case["q"])
    ws = torch.zeros(pqattn.ops.decode_workspace_numel(16, 96, 64), dtype=torch.int32, device=device)
    got = pqattn.sparse_decode(
        case["q"], case["k"], case["v"], case["positions"], case["counts"], out=out, workspace=ws
    )
    assert torch.allclose(got.double(), want, atol=2e-2)
    assert got.data_ptr() == out.data_ptr()
    with pytest.raises(ValueError, match="out"):
        pqattn.sparse_decode(
            case["q"], case["k"], case["v"], case["positions"], case["counts"], out=out.transpose(0, 1)
        )


def test_full_shapes_on_gpu(device: torch.device) -> None:
    if device.type != "cuda":
        pytest.skip("full shapes run compiled on the GPU")
    gen = torch.Generator().manual_seed(int(torch.randint(1 << 30, (1,))))
    for config in DECODE_CONFIGS:
        cfg = {**config.kwargs, "num_warps": config.num_warps}
        for _ in range(3):
            case = draw_decode(gen, device, large=True)
            problem = compare_decode(case, run_decode(case, cfg), reference_decode(case))
            assert problem is None, (case["desc"], problem)


def test_sparse_decode_equals_dense_when_everything_is_selected(device: torch.device, kernel_routes) -> None:
    """Selecting every token reproduces dense attention (SDPA semantics) of one query, on the
    kernel route."""
    B, H, Hkv, N, D = 2, 8, 2, 200, 64
    q = torch.randn(B, H, D, device=device)
    k = torch.randn(B, Hkv, N, D, device=device)
    v = torch.randn(B, Hkv, N, D, device=device)
    positions = torch.arange(N, device=device, dtype=torch.int32).expand(B, H, N)
    counts = torch.full((B, H), N, device=device, dtype=torch.int32)
    got = pqattn.sparse_decode(q, k, v, positions, counts)
    dense = ref.dense_attention(q[:, :, None], k, v)[:, :, 0]
    torch.testing.assert_close(got, dense, atol=1e-5, rtol=1e-5)


GROUP_IDS = [f"L{c.kwargs['BLOCK_L']}-N{c.kwargs['BLOCK_N']}-w{c.num_warps}" for c in GROUP_DECODE_CONFIGS]


@pytest.mark.parametrize("config", GROUP_DECODE_CONFIGS, ids=GROUP_IDS)
@pytest.mark.parametrize(
    "G,dtype,q_dtype",
    [(4, torch.float32, torch.float32), (1, torch.float16, torch.float16), (8, torch.float16, torch.float32)],
)
def test_group_decode_matches_reference(device, config, G, dtype, q_dtype, monkeypatch):
    """The group kernel (one selection per KV head, each gathered row serving its G heads) against
    the per-head reference over the repeated selection: every config, several splits, an empty
    and a full row, lse too. G=1 combines its splits in a loop of two at a time (the path of a
    list wider than the unroll cap), the last block past the splits."""
    if G == 1:
        monkeypatch.setattr(decode, "_UNROLL_MAX", 1)
        monkeypatch.setattr(decode, "_UNROLL_BLOCK", 2)
    B, Hkv, N, D, L = 2, 2, 1200, 32, 1100  # two splits or more at every config's BLOCK_L
    H = G * Hkv
    q = torch.randn(B, H, D).to(q_dtype).to(device)
    k = (3 * torch.randn(B, Hkv, N, D)).to(dtype).to(device)
    v = torch.randn(B, Hkv, N, D).to(dtype).to(device)
    counts = torch.tensor([[L, 0], [17, 433]], dtype=torch.int32)
    positions = torch.rand(B, Hkv, N).argsort(-1)[..., :L]
    positions = torch.where(torch.arange(L) < counts[..., None], positions, -1).to(torch.int32).to(device)
    counts = counts.to(device)
    out = torch.full((B, H, D), float("nan"), dtype=q_dtype, device=device)
    lse = torch.full((B * H,), float("nan"), device=device)
    ws = torch.zeros(group_workspace_numel(B * Hkv, G, L, D), dtype=torch.int32, device=device)
    for _ in range(2):  # the counters are left at zero for the next call
        group_decode(q, k, v, positions, counts, out=out, workspace=ws, lse=lse, config=config)
        want, want_lse = ref.sparse_decode(
            q.double(), k.double(), v.double(), positions.repeat_interleave(G, 1),
            counts.repeat_interleave(G, 1), None, return_lse=True,
        )  # fmt: skip
        tol = 1e-4 if dtype == torch.float32 and q_dtype == torch.float32 else 3e-3
        torch.testing.assert_close(out.double(), want, atol=tol, rtol=tol)
        torch.testing.assert_close(lse.view(B, H).double(), want_lse, atol=tol, rtol=tol)
        assert not ws[: B * Hkv].any()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="bf16 tensor-core products on the GPU")
@pytest.mark.parametrize("config", GROUP_DECODE_CONFIGS, ids=GROUP_IDS)
def test_group_decode_bf16_full_shape_cuda(config):
    B, H, Hkv, N, D, L = 2, 32, 8, 131072, 128, 10_000
    q = torch.randn(B, H, D, dtype=torch.bfloat16, device="cuda")
    k = torch.randn(B, Hkv, N, D, dtype=torch.bfloat16, device="cuda")
    v = torch.randn(B, Hkv, N, D, dtype=torch.bfloat16, device="cuda")
    positions = torch.rand(B, Hkv, N, device="cuda").argsort(-1)[..., :L].to(torch.int32)
    counts = torch.full((B, Hkv), L, dtype=torch.int32, device="cuda")
    counts[1, 3] = 5000
    out = torch.full((B, H, D), float("nan"), dtype=torch.bfloat16, device="cuda")
    ws = torch.zeros(group_workspace_numel(B * Hkv, H // Hkv, L, D), dtype=torch.int32, device="cuda")
    group_decode(q, k, v, positions, counts, out=out, workspace=ws, config=config)
    want = ref.sparse_decode(
        q.float(),
        k.float(),
        v.float(),
        positions.repeat_interleave(4, 1),
        counts.repeat_interleave(4, 1),
        None,
    )
    torch.testing.assert_close(out.float(), want, atol=2e-2, rtol=2e-2)


DENSE_SPACES = DENSE_DECODE_CONFIGS + DENSE_WIDE_CONFIGS
DENSE_IDS = [
    f"L{c.kwargs['BLOCK_L']}-N{c.kwargs['BLOCK_N']}-w{c.num_warps}-s{c.num_stages}" for c in DENSE_SPACES
]


@pytest.mark.parametrize("config", DENSE_SPACES, ids=DENSE_IDS)
@pytest.mark.parametrize("G", [4, 1])
def test_dense_decode_matches_reference(device, config, G, monkeypatch):
    """The group kernel without positions (dense decoding over each row's first counts tokens)
    against the reference: every config, a full row over several splits, an empty row, counts
    inside a split and just past one; the slots past each count hold NaN, so a read past it
    fails. G=1 combines its splits in a loop of two at a time."""
    if G == 1:
        monkeypatch.setattr(decode, "_UNROLL_MAX", 1)
        monkeypatch.setattr(decode, "_UNROLL_BLOCK", 2)
    block = config.kwargs["BLOCK_L"]
    B, Hkv, D, N = 2, 2, 16, 2 * block + 37
    H = G * Hkv
    counts = torch.tensor([[N, 0], [17, block + 3]], dtype=torch.int32)
    k = 3 * torch.randn(B, Hkv, N, D)
    v = torch.randn(B, Hkv, N, D)
    past = torch.arange(N) >= counts[..., None]
    k[past], v[past] = float("nan"), float("nan")
    q = torch.randn(B, H, D)
    positions = torch.arange(N, dtype=torch.int32).expand(B, H, N)
    want, want_lse = ref.sparse_decode(
        q.double(), k.nan_to_num().double(), v.nan_to_num().double(), positions,
        counts.repeat_interleave(G, 1), None, return_lse=True,
    )  # fmt: skip
    q, k, v, counts = q.to(device), k.to(device), v.to(device), counts.to(device)
    out = torch.full((B, H, D), float("nan"), device=device)
    lse = torch.full((B * H,), float("nan"), device=device)
    ws = torch.zeros(group_workspace_numel(B * Hkv, G, N, D, dense=True), dtype=torch.int32, device=device)
    for _ in range(2):  # the counters are left at zero for the next call
        group_decode(q, k, v, None, counts, out=out, workspace=ws, lse=lse, config=config)
        torch.testing.assert_close(out.double().cpu(), want, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(lse.view(B, H).double().cpu(), want_lse, atol=1e-4, rtol=1e-4)
        assert not ws[: B * Hkv].any()


@pytest.mark.parametrize("config", DENSE_SPACES, ids=DENSE_IDS)
def test_dense_decode_from_starts_matches_reference(device, config):
    """Dense decoding over tokens starts[b] .. counts[b] - 1 (a left-padded sequence): NaN in the
    slots before each start and past each count, so a read of one fails; a start inside the first
    split, one past a split's end, and an empty sequence (start = count), against SDPA over the
    slices and against the reference."""
    block = config.kwargs["BLOCK_L"]
    B, Hkv, G, D, N = 3, 2, 4, 16, 2 * block + 37
    H = G * Hkv
    counts = torch.tensor([N, 2 * block, 40], dtype=torch.int32)
    starts = torch.tensor([5, block + 3, 40], dtype=torch.int32)
    k = 3 * torch.randn(B, Hkv, N, D)
    v = torch.randn(B, Hkv, N, D)
    outside = (torch.arange(N) < starts[:, None]) | (torch.arange(N) >= counts[:, None])
    k[outside[:, None].expand(B, Hkv, N)], v[outside[:, None].expand(B, Hkv, N)] = float("nan"), float("nan")
    q = torch.randn(B, H, D)
    want = torch.zeros(B, H, D, dtype=torch.float64)
    for b in range(B):
        lo, hi = int(starts[b]), int(counts[b])
        if hi > lo:
            want[b] = torch.nn.functional.scaled_dot_product_attention(
                q[b, :, None].double(), k[b, :, lo:hi].double(), v[b, :, lo:hi].double(), enable_gqa=True
            )[:, 0]
    got_ref = ref.dense_decode(
        q.double(), k.nan_to_num().double(), v.nan_to_num().double(), counts, starts=starts
    )
    torch.testing.assert_close(got_ref, want)
    q, k, v, counts, starts = q.to(device), k.to(device), v.to(device), counts.to(device), starts.to(device)
    out = torch.full((B, H, D), float("nan"), device=device)
    ws = torch.zeros(group_workspace_numel(B * Hkv, G, N, D, dense=True), dtype=torch.int32, device=device)
    per_head = counts[:, None].expand(B, Hkv)
    for _ in range(2):  # the counters are left at zero for the next call
        group_decode(q, k, v, None, per_head, out=out, workspace=ws, starts=starts, config=config)
        torch.testing.assert_close(out.double().cpu(), want, atol=1e-4, rtol=1e-4)
        assert not ws[: B * Hkv].any()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="bf16 tensor-core products on the GPU")
@pytest.mark.parametrize("config", DENSE_SPACES, ids=DENSE_IDS)
def test_dense_decode_bf16_full_shape_cuda(config):
    B, H, Hkv, N, D = 2, 32, 8, 131072 + 512, 128
    q = torch.randn(B, H, D, dtype=torch.bfloat16, device="cuda")
    k = torch.randn(B, Hkv, N, D, dtype=torch.bfloat16, device="cuda")
    v = torch.randn(B, Hkv, N, D, dtype=torch.bfloat16, device="cuda")
    counts = torch.tensor([131073, 70001], dtype=torch.int32, device="cuda")
    out = torch.full((B, H, D), float("nan"), dtype=torch.bfloat16, device="cuda")
    ws = torch.zeros(
        group_workspace_numel(B * Hkv, H // Hkv, N, D, dense=True), dtype=torch.int32, device="cuda"
    )
    for starts in (None, torch.tensor([9000, 3], dtype=torch.int32, device="cuda")):
        out.fill_(float("nan"))
        per_head = counts[:, None].expand(B, Hkv)
        group_decode(q, k, v, None, per_head, out=out, workspace=ws, starts=starts, config=config)
        for b in range(B):
            lo, n = (0 if starts is None else int(starts[b])), int(counts[b])
            want = torch.nn.functional.scaled_dot_product_attention(
                q[b, :, None].float(), k[b, :, lo:n].float(), v[b, :, lo:n].float(), enable_gqa=True
            )[:, 0]
            torch.testing.assert_close(out[b].float(), want, atol=2e-2, rtol=2e-2)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="compiled: the configs' shared memory on the GPU")
@pytest.mark.parametrize("dtype,D", [(torch.float32, 256), (torch.float32, 128), (torch.bfloat16, 256)])
def test_dense_decode_of_wide_rows_cuda(dtype, D):
    """Float32 and D=256 rows through the autotuned route: every config tried compiles or is
    skipped, and the one chosen is right."""
    B, H, Hkv, N = 2, 8, 2, 9000
    q = torch.randn(B, H, D, dtype=dtype, device="cuda")
    k = torch.randn(B, Hkv, N, D, dtype=dtype, device="cuda")
    v = torch.randn(B, Hkv, N, D, dtype=dtype, device="cuda")
    counts = torch.tensor([N, 4321], dtype=torch.int32, device="cuda")
    got = pqattn.dense_decode(q, k, v, counts)
    want = ref.dense_decode(q.double(), k.double(), v.double(), counts)
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.double(), want, atol=tol, rtol=tol)


def _paged_case(device, *, B, H, Hkv, N, L, D, page, dtype=torch.float32, shared=False):
    max_blocks = -(-N // page)
    blocks = B * max_blocks + 3
    table = torch.randperm(blocks)[: B * max_blocks].reshape(B, max_blocks).to(torch.int32).to(device)
    k = (3 * torch.randn(B, Hkv, N, D)).to(dtype).to(device)
    v = torch.randn(B, Hkv, N, D).to(dtype).to(device)
    R = Hkv if shared else H
    counts = torch.randint(0, L + 1, (B, R), dtype=torch.int32)
    counts[0, 0] = L
    positions = torch.rand(B, R, N).argsort(-1)[..., :L]
    positions = torch.where(torch.arange(L) < counts[..., None], positions, -1).to(torch.int32)
    q = torch.randn(B, H, D).to(dtype).to(device)
    kp, vp = ref.to_pages(k, table, blocks, page), ref.to_pages(v, table, blocks, page)
    return q, k, v, kp, vp, table, positions.to(device), counts.to(device)


@pytest.mark.parametrize("config", DECODE_CONFIGS, ids=CONFIG_IDS)
@pytest.mark.parametrize("page", [16, 5])
def test_paged_decode_matches_the_contiguous_cache(device, config, page):
    """A paged cache (SPEC §8: shuffled blocks, unused blocks of NaN, a page size that does not
    divide N) gives the contiguous cache's answer, with entry and dense weights."""
    q, k, v, kp, vp, table, positions, counts = _paged_case(
        device, B=2, H=4, Hkv=2, N=301, L=2 * config.kwargs["BLOCK_L"] + 3, D=32, page=page
    )
    B, H, D, L = *q.shape, positions.shape[-1]
    for weights, dense in ((None, False), (torch.rand(B, H, L, device=device) + 0.1, False),
                           (torch.rand(B, H, 301, device=device) + 0.1, True)):  # fmt: skip
        out = torch.full_like(q, float("nan"))
        lse = torch.full((B * H,), float("nan"), device=device)
        ws = torch.zeros(pqattn.ops.decode_workspace_numel(B * H, L, D), dtype=torch.int32, device=device)
        sparse_decode(
            q, kp, vp, positions, counts, out=out, workspace=ws, weights=weights, dense_weights=dense,
            lse=lse, block_table=table, config=config,
        )  # fmt: skip
        w = weights.gather(-1, positions.long().clamp_min(0)) if dense else weights
        want, want_lse = ref.sparse_decode(
            q.double(), k.double(), v.double(), positions, counts, w, return_lse=True
        )
        torch.testing.assert_close(out.double(), want, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(lse.view(B, H).double(), want_lse, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("config", GROUP_DECODE_CONFIGS, ids=GROUP_IDS)
def test_paged_group_decode_matches_the_contiguous_cache(device, config):
    q, k, v, kp, vp, table, positions, counts = _paged_case(
        device, B=2, H=8, Hkv=2, N=700, L=600, D=32, page=16, shared=True
    )
    G = 4
    out = torch.full_like(q, float("nan"))
    ws = torch.zeros(group_workspace_numel(4, G, 600, 32), dtype=torch.int32, device=device)
    group_decode(q, kp, vp, positions, counts, out=out, workspace=ws, block_table=table, config=config)
    want = ref.sparse_decode(
        q.double(), k.double(), v.double(), positions.repeat_interleave(G, 1), counts.repeat_interleave(G, 1)
    )
    torch.testing.assert_close(out.double(), want, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("config", DENSE_SPACES, ids=DENSE_IDS)
def test_paged_dense_decode_matches_the_contiguous_cache(device, config):
    """Dense decoding over a paged cache (shuffled blocks, a page that does not divide the
    tokens, NaN in the unused blocks) gives the contiguous cache's answer."""
    B, H, Hkv, D, page = 2, 8, 2, 16, 48
    N = config.kwargs["BLOCK_L"] + 100
    q, k, v, kp, vp, table, _, _ = _paged_case(
        device, B=B, H=H, Hkv=Hkv, N=N, L=1, D=D, page=page, shared=True
    )
    counts = torch.tensor([N, 700], dtype=torch.int32, device=device)[:, None].expand(B, Hkv)
    out = torch.full_like(q, float("nan"))
    width = table.shape[1] * page
    ws = torch.zeros(
        group_workspace_numel(B * Hkv, 4, width, D, dense=True), dtype=torch.int32, device=device
    )
    group_decode(q, kp, vp, None, counts, out=out, workspace=ws, block_table=table, config=config)
    want = ref.dense_decode(q.double(), k.double(), v.double(), counts[:, 0])
    torch.testing.assert_close(out.double(), want, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize(
    "dtype,D,space",
    [(torch.bfloat16, 128, DENSE_DECODE_CONFIGS), (torch.float32, 128, DENSE_WIDE_CONFIGS),
     (torch.bfloat16, 256, DENSE_DECODE_CONFIGS), (torch.float32, 256, DENSE_WIDE_CONFIGS)],
)  # fmt: skip
def test_dense_decode_takes_the_space_its_rows_fit(device, dtype, D, space, monkeypatch):
    """Float32 products take the two-stage space (the three-stage configs would not fit an SM's
    shared memory, bench/decode_smem.py): without autotuning the launch is that space's first
    config."""
    launched = []
    monkeypatch.setattr(decode, "autotuning", lambda: False)
    monkeypatch.setattr(decode, "_group_decode_launch", lambda grid, t, s, meta: launched.append(meta))
    B, Hkv, N = 1, 2, 64
    q = torch.randn(B, 8, D, device=device, dtype=dtype)
    k = torch.randn(B, Hkv, N, D, device=device, dtype=dtype)
    counts = torch.full((B, Hkv), N, dtype=torch.int32, device=device)
    ws = torch.zeros(group_workspace_numel(B * Hkv, 4, N, D, dense=True), dtype=torch.int32, device=device)
    decode.group_decode(q, k, k, None, counts, out=torch.empty_like(q), workspace=ws)
    assert [(m["BLOCK_N"], m["num_stages"]) for m in launched] == [
        (space[0].kwargs["BLOCK_N"], space[0].num_stages)
    ]


def test_a_growing_cache_keeps_its_dense_width(device, monkeypatch):
    """Dense decoding over caches of 1, 4095, 4096 and 4097 tokens: the list width (a constexpr)
    is the tokens rounded up to DENSE_WIDTH_STEP, so a cache that grows a token a step compiles
    anew only at each step's multiple."""
    launched = []
    monkeypatch.setattr(decode, "autotuning", lambda: False)
    monkeypatch.setattr(
        decode, "_group_decode_launch", lambda grid, t, s, meta: launched.append(meta["WIDTH"])
    )
    B, Hkv, D = 1, 2, 16
    q = torch.randn(B, 8, D, device=device)
    for n in (1, 4095, 4096, 4097):
        k = torch.randn(B, Hkv, n, D, device=device)
        counts = torch.full((B, Hkv), n, dtype=torch.int32, device=device)
        ws = torch.zeros(pqattn.ops.decode_workspace_numel(B * Hkv, n, D, group=4), dtype=torch.int32,
                         device=device)  # fmt: skip
        decode.group_decode(q, k, k, None, counts, out=torch.empty_like(q), workspace=ws)
    assert launched == [decode.DENSE_WIDTH_STEP] * 3 + [2 * decode.DENSE_WIDTH_STEP]


@pytest.mark.parametrize("config", DENSE_SPACES, ids=DENSE_IDS)
def test_dense_decode_reads_no_row_past_the_cache(device, config):
    """Counts past the cache's tokens (which a replayed plan does not check) are clamped to them
    in the kernel: the cache is a view whose rows beyond it hold NaN, the list's width is wider
    still, and the answer is attention over the cache's rows."""
    B, Hkv, G, D, N = 1, 2, 4, 16, 100
    H = G * Hkv
    k_all, v_all = 3 * torch.randn(B, Hkv, N + 64, D), torch.randn(B, Hkv, N + 64, D)
    k_all[:, :, N:], v_all[:, :, N:] = float("nan"), float("nan")
    q = torch.randn(B, H, D)
    want = ref.dense_decode(q.double(), k_all[:, :, :N].double(), v_all[:, :, :N].double(), torch.tensor([N]))
    q, k_all, v_all = q.to(device), k_all.to(device), v_all.to(device)
    counts = torch.full((B, Hkv), N + 64, dtype=torch.int32, device=device)
    out = torch.full((B, H, D), float("nan"), device=device)
    ws = torch.zeros(group_workspace_numel(B * Hkv, G, N, D, dense=True), dtype=torch.int32, device=device)
    group_decode(q, k_all[:, :, :N], v_all[:, :, :N], None, counts, out=out, workspace=ws, config=config)
    torch.testing.assert_close(out.double().cpu(), want, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("route", ["reference", "kernel"])
def test_dense_decode_through_the_api(device, route, request):
    """ops.dense_decode: the reference route and the kernel (a kept plan replayed into the given
    buffers) agree with SDPA over each sequence's first counts tokens; bad inputs are refused
    naming the argument."""
    if route == "kernel":
        request.getfixturevalue("kernel_routes")
    B, H, Hkv, N, D = 2, 8, 2, 300, 32
    q = torch.randn(B, H, D, device=device)
    k, v = torch.randn(B, Hkv, N, D, device=device), torch.randn(B, Hkv, N, D, device=device)
    counts = torch.tensor([N, 123], dtype=torch.int32, device=device)
    out = torch.full_like(q, float("nan"))
    ws = torch.zeros(pqattn.ops.decode_workspace_numel(B * Hkv, N, D, group=H // Hkv), dtype=torch.int32,
                     device=device)  # fmt: skip
    for _ in range(2):
        got = pqattn.dense_decode(q, k, v, counts, scale=0.2, out=out, workspace=ws)
        assert got.data_ptr() == out.data_ptr()
        for b in range(B):
            n = int(counts[b])
            want = torch.nn.functional.scaled_dot_product_attention(
                q[b, :, None], k[b, :, :n], v[b, :, :n], scale=0.2, enable_gqa=True
            )[:, 0]
            torch.testing.assert_close(out[b], want, atol=1e-5, rtol=1e-5)
    _, lse = pqattn.dense_decode(q, k, v, counts, return_lse=True)
    want_lse = ref.sparse_decode(
        q, k, v, torch.arange(N, device=device).expand(B, H, N), counts[:, None].expand(B, H), return_lse=True
    )[1]
    torch.testing.assert_close(lse, want_lse.float(), atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match=r"counts: expected token counts in \[0, 300\]"):
        pqattn.dense_decode(q, k, v, torch.tensor([N + 1, 5], dtype=torch.int32, device=device))
    with pytest.raises(ValueError, match="counts"):
        pqattn.dense_decode(q, k, v, counts[:, None].expand(B, Hkv))
    if route == "kernel":  # (the reference route reads no workspace)
        with pytest.raises(ValueError, match="workspace"):
            pqattn.dense_decode(q, k, v, counts, workspace=ws[:10])
    starts = torch.tensor([7, 123], dtype=torch.int32, device=device)  # the second sequence: no tokens
    for _ in range(2):  # a plan of its own, replayed
        pqattn.dense_decode(q, k, v, counts, scale=0.2, out=out, workspace=ws, starts=starts)
        want = torch.nn.functional.scaled_dot_product_attention(
            q[0, :, None], k[0, :, 7:N], v[0, :, 7:N], scale=0.2, enable_gqa=True
        )[:, 0]
        torch.testing.assert_close(out[0], want, atol=1e-5, rtol=1e-5)
        assert not out[1].any()
    with pytest.raises(ValueError, match=r"starts: expected each in \[0, counts\[b\]\]"):
        pqattn.dense_decode(q, k, v, counts, starts=torch.tensor([0, 124], dtype=torch.int32, device=device))
    with pytest.raises(ValueError, match="starts"):
        pqattn.dense_decode(q, k, v, counts, starts=starts[:1])


@pytest.mark.parametrize("route", ["reference", "kernel"])
def test_paged_through_the_api_with_append(device, route, request):
    """ops.paged_append writes each sequence's token at its length through its table; then
    ops.sparse_decode over the paged cache equals it over the contiguous one (per head and
    shared), on the reference route and on the kernels (a kept plan replayed too)."""
    if route == "kernel":
        request.getfixturevalue("kernel_routes")
    B, H, Hkv, N, D, page = 2, 4, 2, 90, 16, 8
    q, k, v, kp, vp, table, positions, counts = _paged_case(
        device, B=B, H=H, Hkv=Hkv, N=N, L=40, D=D, page=page
    )
    lengths = torch.tensor([N - 1, 50], device=device)
    k_new, v_new = torch.randn(B, Hkv, D, device=device), torch.randn(B, Hkv, D, device=device)
    pqattn.paged_append(kp, vp, table, lengths, k_new, v_new)
    for b in range(B):
        k[b, :, int(lengths[b])], v[b, :, int(lengths[b])] = k_new[b], v_new[b]
    torch.testing.assert_close(ref.unpage(kp, table)[:, :, :N], k)
    want = ref.sparse_decode(q, k, v, positions, counts)
    out = torch.empty_like(q)
    ws = torch.zeros(pqattn.ops.decode_workspace_numel(B * H, 40, D), dtype=torch.int32, device=device)
    for _ in range(2):
        got = pqattn.sparse_decode(q, kp, vp, positions, counts, block_table=table, out=out, workspace=ws)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    shared_pos, shared_cnt = positions[:, ::2], counts[:, ::2]
    got = pqattn.sparse_decode(q, kp, vp, shared_pos, shared_cnt, block_table=table)
    want = ref.sparse_decode(q, k, v, shared_pos.repeat_interleave(2, 1), shared_cnt.repeat_interleave(2, 1))
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_paged_inputs_are_checked(device):
    q, _, _, kp, vp, table, positions, counts = _paged_case(device, B=2, H=4, Hkv=2, N=64, L=8, D=16, page=8)
    args = (q, kp, vp, positions, counts)
    with pytest.raises(ValueError, match=r"block_table: expected block indices in \[0, 19\)"):
        pqattn.sparse_decode(*args, block_table=torch.where(table == table[1, 2], 19, table))
    with pytest.raises(TypeError, match="block_table: expected dtype"):
        pqattn.sparse_decode(*args, block_table=table.float())
    with pytest.raises(ValueError, match=r"block_table: expected shape \[B, max_blocks\]"):
        pqattn.sparse_decode(*args, block_table=table[:1])
    with pytest.raises(ValueError, match="v: expected shape"):
        pqattn.sparse_decode(q, kp, vp[:, :4], positions, counts, block_table=table)
    with pytest.raises(ValueError, match="positions"):
        pqattn.sparse_decode(q, kp, vp, positions.masked_fill(positions >= 0, 64), counts, block_table=table)
    new = torch.zeros(2, 2, 16, device=device)
    with pytest.raises(ValueError, match=r"lengths: expected slots in \[0, 64\)"):
        pqattn.paged_append(kp, vp, table, torch.tensor([3, 64], device=device), new, new)
    with pytest.raises(ValueError, match="k_new"):
        pqattn.paged_append(kp, vp, table, torch.tensor([3, 4], device=device), new[:, :1], new)


def test_paged_append_checks_values_once_per_signature(device, monkeypatch):
    """A decode loop's paged_append reads the lengths on the host at its first step only (the
    steps after check shapes, as a kept plan does); a new signature is checked again."""
    reads = []
    checking = pqattn.ops.check.checking_values
    monkeypatch.setattr(pqattn.ops.check, "checking_values", lambda t: reads.append(t) or checking(t))
    monkeypatch.setattr(pqattn.ops, "_PAGED_CHECKED", set())
    _, _, _, kp, vp, table, _, _ = _paged_case(device, B=2, H=4, Hkv=2, N=40, L=8, D=16, page=8)
    new = torch.randn(2, 2, 16, device=device)
    lengths = torch.tensor([5, 9], device=device)
    for _ in range(3):
        pqattn.paged_append(kp, vp, table, lengths, new, new)
        lengths += 1
    assert len(reads) == 2  # the block table and the lengths, at the first call
    torch.testing.assert_close(ref.unpage(kp, table)[1, :, 9:12], new[1, :, None].expand(2, 3, 16))
    pqattn.paged_append(kp, vp, table.long(), lengths, new, new)
    assert len(reads) == 4
