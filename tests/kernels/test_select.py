"""The fused selection and encode kernels against the reference: named edge cases, every config.

Runs under the Triton interpreter on a CPU (small shapes) and compiled on a GPU (also large ones).
The random fuzz over all configs is `pqattn check` (tests/lab/test_check.py runs it too).
"""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

import pqattn
from pqattn import reference as ref
from pqattn.kernels.select.tree import (
    SELECT_CONFIGS,
    SLACK_HEAVY_MAX,
    SLACK_TOKENS_MAX,
    _top_k,
    configs_for,
    k_pad,
    pq_select,
    workspace_numel,
)
from pqattn.lab.kernel_checks import selection_problem
from pqattn.limits import MAX_TREE_HEAVY
from tests.kernels.selection_case import SelectionCase

CONFIG_IDS = [f"TILE{c.kwargs['TILE']}-w{c.num_warps}" for c in SELECT_CONFIGS]


def run_case(device, *, config, lut_kernel=None, workspace=None, calls=1, **shape) -> None:
    case = SelectionCase.draw(device, **shape)
    B, H, _ = case.q.shape
    M, C, N = case.centroids.shape[2], case.C, case.codes.shape[2]
    if workspace is None:
        workspace = torch.zeros(
            workspace_numel(B * H, M, C, N, case.params.heavy), dtype=torch.int32, device=device
        )
    for _ in range(calls):  # later calls reuse the workspace: the kernel must leave it reusable
        case.q.normal_()
        pq_select(
            case.q,
            case.centroids,
            case.codes,
            case.lengths,
            case.params,
            **case.outputs(),
            workspace=workspace,
            n_tokens=N,
            config=config,
            lut_kernel=lut_kernel,
        )
        case.check()


@pytest.mark.parametrize("config", SELECT_CONFIGS, ids=CONFIG_IDS)
@pytest.mark.parametrize(
    "case",
    [
        dict(
            B=1,
            H=2,
            Hkv=2,
            N=300,
            D=32,
            M=2,
            bits=6,
            lengths=[300],
            sink=4,
            window=8,
            heavy=20,
            init_offset=4,
        ),
        dict(
            B=3,
            H=8,
            Hkv=2,
            N=211,
            D=64,
            M=4,
            bits=4,
            lengths=[211, 97, 30],
            sink=3,
            window=5,
            heavy=17,
            init_offset=6,
        ),  # ragged, GQA 4, one sequence under the short rule
        dict(
            B=2,
            H=4,
            Hkv=4,
            N=64,
            D=32,
            M=8,
            bits=3,
            lengths=[64, 61],
            sink=2,
            window=2,
            heavy=100,
            init_offset=0,
        ),  # heavy > candidates (and short)
        dict(
            B=2,
            H=2,
            Hkv=1,
            N=150,
            D=32,
            M=16,
            bits=1,
            lengths=[150, 0],
            sink=5,
            window=5,
            heavy=9,
            init_offset=12,
        ),  # C=2: scores take few values (ties everywhere); an empty sequence
        dict(
            B=1, H=4, Hkv=2, N=120, D=64, M=1, bits=8, lengths=[120], sink=0, window=0, heavy=7, init_offset=0
        ),  # no sink, no window, M=1, C=256
    ],
    ids=["basic", "ragged-gqa-short", "heavy-exceeds", "ties-empty", "no-sink-window-M1"],
)
def test_select_cases(case: dict, config: triton.Config, device: torch.device) -> None:
    run_case(device, **case, config=config)


@pytest.mark.parametrize("lut_kernel", [False, True], ids=["lut-in-leaves", "lut-kernel"])
@pytest.mark.parametrize("config", SELECT_CONFIGS, ids=CONFIG_IDS)
@pytest.mark.parametrize("bits", [4, 2], ids=["C16", "C4-ties"])
def test_select_merge_tree(bits: int, config: triton.Config, lut_kernel: bool, device: torch.device) -> None:
    """Rows of 6-7 leaves merged over two levels (four children per merge), ragged, with weights,
    called twice on one workspace. C=4, M=2: 16 distinct scores, ties across every leaf."""
    tile = config.kwargs["TILE"]
    N = tile * 6 + tile // 3
    # the largest of these whose slots are a quarter of the tile (doubled slots up to SLACK_HEAVY_MAX)
    heavy = next(h for h in (tile // 4 - 3, tile // 8 - 3) if k_pad(h, N) == tile // 4)
    run_case(
        device,
        B=2,
        H=4,
        Hkv=2,
        N=N,
        D=32,
        M=2,
        bits=bits,
        lengths=[N, N // 2 + 7],
        sink=5,
        window=9,
        heavy=heavy,
        init_offset=11,
        config=config,
        weights_dtype=torch.bfloat16,
        lut_kernel=lut_kernel,
        calls=2,
    )


def test_configs_share_one_workspace(device: torch.device) -> None:
    """Every config, one after another, on one workspace (what the autotuner's trials do): the
    counters of one config must never be written over by another config's slots."""
    B, H, M, bits, N, heavy = 1, 2, 2, 4, 5 * 2048 + 100, 100
    ws = torch.zeros(workspace_numel(B * H, M, 2**bits, N, heavy), dtype=torch.int32, device=device)
    for config in [*reversed(SELECT_CONFIGS), *SELECT_CONFIGS]:
        run_case(
            device,
            B=B,
            H=H,
            Hkv=1,
            N=N,
            D=16,
            M=M,
            bits=bits,
            lengths=[N],
            sink=2,
            window=3,
            heavy=heavy,
            init_offset=2,
            config=config,
            workspace=ws,
        )


def test_configs_for_heavy() -> None:
    """At least four children per merge, except above 4096 where the largest tile merges two;
    slots of at least twice heavy up to SLACK_HEAVY_MAX and SLACK_TOKENS_MAX, of heavy above."""
    for n_tokens in (1000, SLACK_TOKENS_MAX, SLACK_TOKENS_MAX + 1):
        for heavy in (1, 128, 511, 512, 1024, 1025, 4096, MAX_TREE_HEAVY):
            tiles = [c.kwargs["TILE"] for c in configs_for(heavy, n_tokens)]
            kp = k_pad(heavy, n_tokens)
            slack = heavy <= SLACK_HEAVY_MAX and n_tokens <= SLACK_TOKENS_MAX
            assert kp >= (2 * heavy if slack else heavy) and kp & (kp - 1) == 0, (heavy, n_tokens, kp)
            assert kp < (4 * heavy if slack else 2 * heavy), (heavy, n_tokens, kp)
            assert tiles and all(t >= (4 * kp if heavy <= 4096 else 2 * kp) for t in tiles), (heavy, tiles)
        assert configs_for(MAX_TREE_HEAVY + 1, n_tokens) == ()


def test_bad_workspace_and_config_are_refused() -> None:
    q = torch.randn(1, 2, 32)
    cent = torch.randn(1, 2, 2, 16, 16)
    codes = torch.zeros(1, 2, 100, 2, dtype=torch.uint8)
    kw = dict(
        positions=torch.empty(1, 2, 902, dtype=torch.int32),
        counts=torch.empty(1, 2, dtype=torch.int32),
        n_tokens=100,
    )
    params = ref.SelectParams(sink=1, window=1, heavy=900, cand_lo=1, short_threshold=902, width=902)
    lens = torch.tensor([100])
    with pytest.raises(ValueError, match="workspace"):
        pq_select(q, cent, codes, lens, params, **kw, workspace=torch.zeros(10, dtype=torch.int32))
    with pytest.raises(ValueError, match="config"):
        pq_select(
            q,
            cent,
            codes,
            lens,
            params,
            **kw,
            workspace=torch.zeros(1, dtype=torch.int32),
            config=SELECT_CONFIGS[0],
        )
    with pytest.raises(ValueError, match="heavy"):
        too_many = params._replace(heavy=MAX_TREE_HEAVY + 1)
        pq_select(q, cent, codes, lens, too_many, **kw, workspace=torch.zeros(1, dtype=torch.int32))


@pytest.mark.parametrize("q_dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("weights_dtype", [torch.float32, torch.bfloat16])
def test_all_equal_scores_and_weights(q_dtype, weights_dtype, device: torch.device) -> None:
    """Zero centroids: every score ties; any `heavy` candidates are a correct answer."""
    run_case(
        device,
        B=2,
        H=2,
        Hkv=1,
        N=90,
        D=32,
        M=2,
        bits=2,
        lengths=[90, 77],
        sink=3,
        window=4,
        heavy=11,
        init_offset=3,
        centroids=torch.zeros(2, 1, 2, 4, 16),
        q_dtype=q_dtype,
        weights_dtype=weights_dtype,
        config=SELECT_CONFIGS[0],
    )


def test_large_shapes_on_gpu(device: torch.device) -> None:
    if device.type != "cuda":
        pytest.skip("large shapes run compiled on the GPU")
    # slots of twice heavy (N32K), of heavy (heavy 2048; N256K, past SLACK_TOKENS_MAX), two children per merge
    for N, heavy in ((32000, 128), (131072, 2048), (1 << 18, 128), (1 << 20, 8192)):
        run_case(
            device,
            B=2,
            H=32,
            Hkv=8,
            N=N,
            D=128,
            M=2,
            bits=6,
            lengths=[N, N // 3],
            sink=128,
            window=128,
            heavy=heavy,
            init_offset=128,
            config=None,
            q_dtype=torch.bfloat16,
        )


def test_ops_routes_cuda_to_the_kernel_without_sync(device: torch.device) -> None:
    """A decode loop's call (select_topk given its buffers, after a first call that validated the
    lengths with one host read) replays its plan: the kernel, no sync."""
    if device.type != "cuda":
        pytest.skip("the kernel path is taken for CUDA tensors")
    B, H, Hkv, N, D = 2, 32, 8, 4096, 128
    keys = torch.randn(B, Hkv, N, D, device=device)
    book = pqattn.build_index(keys, [N, 3000], subvectors=2, bits=6, init_offset=16, iters=2)
    q = torch.randn(B, H, D, device=device, dtype=torch.bfloat16)
    lens = torch.tensor([N, 3000], device=device)
    kw = dict(sink=16, window=32, heavy=256, init_offset=16)
    out = pqattn.Selection(
        torch.empty(B, H, 304, dtype=torch.int32, device=device),
        torch.empty(B, H, dtype=torch.int32, device=device),
    )
    ws = torch.zeros(
        pqattn.ops.select_workspace_numel(B * H, 2, 64, N, 256), dtype=torch.int32, device=device
    )
    for _ in range(2):  # validates: the first autotunes, the second's launches make the plan
        pqattn.select_topk(q, book.centroids, book.codes, lens, **kw, out=out, workspace=ws)
    torch.cuda.set_sync_debug_mode("error")
    try:
        sel = pqattn.select_topk(q, book.centroids, book.codes, lens, **kw, out=out, workspace=ws)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    scores = ref.pq_scores(q.double(), book.centroids.double(), book.codes)
    want = ref.select_from_scores(scores, lens, sink=16, window=32, heavy=256, init_offset=16)
    assert (
        selection_problem(*sel, scores, lens, cand_lo=16, window=32, short_threshold=304, ref_sel=want)
        is None
    )


def test_index_decode_step_in_a_cuda_graph(device: torch.device) -> None:
    """append (encode kernel) + select (selection kernel) captured once, replayed per step."""
    if device.type != "cuda":
        pytest.skip("CUDA graphs need a GPU")
    B, H, Hkv, N, D, steps = 2, 8, 2, 2048, 64, 4
    keys = torch.randn(B, Hkv, N + steps, D, device=device)
    config = pqattn.PQConfig(subvectors=4, bits=5, sink=8, window=16, heavy=64, iters=3, share="head")
    index = pqattn.PQIndex.build(keys[:, :, :N], [N, N - 100], capacity=N + steps, config=config)
    shadow = pqattn.PQIndex.build(keys[:, :, :N], [N, N - 100], capacity=N + steps, config=config)
    k_new = torch.empty(B, Hkv, 1, D, device=device)
    q = torch.empty(B, H, D, device=device)
    k_new.copy_(keys[:, :, N : N + 1])
    q.normal_()
    index.select(q)  # warm-up: autotune and buffers
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        index.append(k_new)
        sel = index.select(q)
    for t in range(steps):
        k_new.copy_(keys[:, :, N + t : N + t + 1])
        q.normal_()
        graph.replay()
        shadow.append(keys[:, :, N + t : N + t + 1])
        want = shadow.select(q)
        torch.cuda.synchronize()
        assert torch.equal(index.lengths, shadow.lengths)
        assert torch.equal(index.codes, shadow.codes)
        assert torch.equal(sel.counts, want.counts)
        scores = ref.pq_scores(q.double(), index.centroids.double(), index.codes)
        ref_sel = ref.select_from_scores(scores, index.lengths, sink=8, window=16, heavy=64, init_offset=8)
        assert (
            selection_problem(
                *sel, scores, index.lengths, cand_lo=8, window=16, short_threshold=88, ref_sel=ref_sel
            )
            is None
        )
    index.sync_lengths()
    assert index._max_length == N + steps


@triton.jit
def _top_k_probe(key_ptr, need, cap, take_ptr, out_ptr, T: tl.constexpr):
    lane = tl.arange(0, T)
    take, k, kth = _top_k(tl.load(key_ptr + lane).to(tl.uint32, bitcast=True), need, cap)
    tl.store(take_ptr + lane, take.to(tl.int8))
    tl.store(out_ptr, k)
    tl.store(out_ptr + 1, kth.to(tl.int32, bitcast=True))


def _key_sets(T: int, g: torch.Generator) -> dict[str, torch.Tensor]:
    full = torch.randint(1, 2**32, (T,), generator=g, dtype=torch.int64)
    few = torch.randint(0, 3, (T,), generator=g) * 1000 + 5
    sparse = torch.where(torch.rand(T, generator=g) < 0.9, 0, full)
    extremes = torch.where(torch.rand(T, generator=g) < 0.5, 1, 2**32 - 1)
    floats = torch.randn(T, generator=g).view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    order = torch.where(floats >> 31 == 1, floats ^ 0xFFFFFFFF, floats | 0x80000000)  # score-like keys
    return {
        "full-range": full,
        "three-values": few,
        "all-equal": torch.full((T,), 77),
        "mostly-zero": sparse,
        "extremes": extremes,
        "consecutive": torch.randperm(T, generator=g) + 1,
        "scores": order,
    }


@pytest.mark.parametrize(
    "dist", ["full-range", "three-values", "all-equal", "mostly-zero", "extremes", "consecutive", "scores"]
)
def test_top_k_search(dist: str, device: torch.device) -> None:
    """The tile top-k on adversarial key sets (0 = not a candidate): for need and a cap (the slot's
    width; cap <= need asks for exactly need), k entries taken with min(need, candidates) <= k <=
    max(cap, need) (exactly min(need, candidates) when cap <= need), every one a candidate, none
    smaller than a candidate left out, and kth the smallest key taken."""
    T = 256
    g = torch.Generator().manual_seed(7)
    keys = _key_sets(T, g)[dist]
    n_nz = int((keys != 0).sum())
    key32 = keys.to(torch.int64).to(torch.int32).to(device)  # the same 32 bits, stored signed
    for need in sorted({0, 1, 2, 37, n_nz - 1, n_nz, n_nz + 5, T}):
        for cap in sorted({need, need + 1, 2 * need + 3, T}):
            if need < 0:
                continue
            take = torch.full((T,), -1, dtype=torch.int8, device=device)
            out = torch.full((2,), -1, dtype=torch.int32, device=device)
            _top_k_probe[(1,)](key32, need, cap, take, out, T=T, num_warps=4)
            take, k = take.cpu().bool(), int(out[0].cpu())
            kth = int(out[1].cpu()) & 0xFFFFFFFF
            least = min(need, n_nz)
            if cap <= need:
                assert k == least, (need, cap, k)
            else:
                assert least <= k <= max(cap, least), (need, cap, k)
            assert int(take.sum()) == k, (need, cap, int(take.sum()))
            assert (keys[take] != 0).all()
            rest = keys[(~take) & (keys != 0)]
            if k:
                assert kth == int(keys[take].min()), (need, cap)
                if rest.numel():
                    assert int(keys[take].min()) >= int(rest.max()), (need, cap)
