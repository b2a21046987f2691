"""The histogram selection (C**M <= 4096) and the histogram that pq_encode keeps, against the reference.

Runs under the Triton interpreter on a CPU (small shapes) and compiled on a GPU (also large ones).
The random fuzz over all configs is `pqattn check` (the `pq_select_hist` rows).
"""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

import pqattn
from pqattn import ops
from pqattn import reference as ref
from pqattn.kernels.encode import pq_encode
from pqattn.kernels.select.common import _normal_probes, order_key, weighted_cut
from pqattn.kernels.select.hist import (
    ROW_WORDS,
    SCAN_CONFIGS,
    count_combos,
    pq_select_hist,
    workspace_layout,
    workspace_numel,
)
from pqattn.kernels.select.tree import workspace_numel as tree_workspace_numel
from pqattn.limits import STATELESS_TREE_MAX_HEAVY
from pqattn.runtime.launch import recording
from tests.helpers import assert_index_selection, assert_selection_exact, select_hist_launches
from tests.kernels.selection_case import SelectionCase

CONFIG_IDS = [f"TILE{c.kwargs['TILE']}-w{c.num_warps}" for c in SCAN_CONFIGS]


def _histogram(codes, lengths, C, window, cand_lo) -> torch.Tensor:
    """The candidate counts per code combination, from the codes in plain torch."""
    B, Hkv, N, M = codes.shape
    combo = torch.zeros(B, Hkv, N, dtype=torch.long, device=codes.device)
    for m in range(M):
        combo = combo * C + codes[..., m].long()
    p = torch.arange(N, device=codes.device)
    cand = (p >= cand_lo) & (p < lengths.long()[:, None] - window)  # [B, N]
    hist = torch.zeros(B, Hkv, C**M, dtype=torch.long, device=codes.device)
    hist.scatter_add_(2, combo, cand[:, None, :].expand(B, Hkv, N).long())
    return hist.int()


def run_case(device, *, config, maintained, calls=2, **shape) -> None:
    case = SelectionCase.draw(device, **shape)
    B, H, _ = case.q.shape
    M, C, N = case.centroids.shape[2], case.C, case.codes.shape[2]
    p = case.params
    workspace = torch.zeros(workspace_numel(B * H, M, C), dtype=torch.int32, device=device)
    hist = _histogram(case.codes, case.lengths, C, p.window, p.cand_lo) if maintained else None
    for _ in range(calls):  # later calls reuse the workspace: the kernels must leave it reusable
        case.q.normal_()
        pq_select_hist(
            case.q,
            case.centroids,
            case.codes,
            case.lengths,
            p,
            **case.outputs(),
            workspace=workspace,
            n_tokens=N,
            histogram=hist,
            config=config,
        )
        case.check()
        hist_off = workspace_layout(B * H, M, C)[0]
        if not maintained:
            assert (workspace[hist_off : hist_off + B * H * C**M] == 0).all(), "consumed histogram zeroed"


CASES = {
    "basic": dict(
        B=1, H=2, Hkv=2, N=300, D=32, M=2, bits=6, lengths=[300], sink=4, window=8, heavy=20, init_offset=4
    ),
    # ragged, GQA 4, one sequence under the short rule
    "ragged-gqa-short": dict(
        B=3,
        H=8,
        Hkv=2,
        N=211,
        D=64,
        M=4,
        bits=3,
        lengths=[211, 97, 30],
        sink=3,
        window=5,
        heavy=17,
        init_offset=6,
    ),
    # heavy > candidates (and short)
    "heavy-exceeds": dict(
        B=2, H=4, Hkv=4, N=64, D=32, M=8, bits=1, lengths=[64, 61], sink=2, window=2, heavy=100, init_offset=0
    ),
    # C=2, M=4: 16 distinct scores (ties everywhere); an empty sequence
    "ties-empty": dict(
        B=2, H=2, Hkv=1, N=150, D=32, M=4, bits=1, lengths=[150, 0], sink=5, window=5, heavy=9, init_offset=12
    ),
    "no-sink-window-M1": dict(
        B=1, H=4, Hkv=2, N=120, D=64, M=1, bits=8, lengths=[120], sink=0, window=0, heavy=7, init_offset=0
    ),
    # several tiles of every config, ties at the cut shared between tiles, weights
    "tiles-ties-weights": dict(
        B=2,
        H=4,
        Hkv=2,
        N=9000,
        D=32,
        M=1,
        bits=2,
        lengths=[9000, 4000],
        sink=4,
        window=8,
        heavy=700,
        init_offset=4,
        round_centroids=True,
        weights_dtype=torch.bfloat16,
    ),
}


@pytest.mark.parametrize("maintained", [False, True], ids=["counted", "maintained"])
@pytest.mark.parametrize("config", SCAN_CONFIGS, ids=CONFIG_IDS)
@pytest.mark.parametrize("case", list(CASES.values()), ids=list(CASES))
def test_select_cases(case: dict, config: triton.Config, maintained: bool, device: torch.device) -> None:
    run_case(device, **case, config=config, maintained=maintained)


def test_count_combos_matches_torch(device: torch.device) -> None:
    codes = torch.randint(0, 8, (2, 3, 5000, 2), device=device, dtype=torch.uint8)
    lens = torch.tensor([5000, 1234], device=device)
    hist = torch.zeros(2, 3, 64, dtype=torch.int32, device=device)
    count_combos(codes, lens, hist, C=8, window=7, cand_lo=5)
    assert torch.equal(hist, _histogram(codes, lens, 8, 7, 5))


@pytest.mark.parametrize(
    "T, window, lengths", [(1, 8, [300, 0]), (9, 6, [100, 3]), (4, 0, [50, 7]), (3, 3, [2, 40])]
)
def test_encode_keeps_the_histogram(T: int, window: int, lengths: list[int], device: torch.device) -> None:
    """Appends of T keys (T above and below the window) move tokens out of the window into the
    candidates: the histogram the encode launch keeps equals a fresh count after every append."""
    B, Hkv, N, D, M, C, cand_lo = 2, 2, 400, 32, 2, 4, 5
    cent = torch.randn(B, Hkv, M, C, D // M, device=device)
    codes = torch.randint(0, C, (B, Hkv, N, M), device=device, dtype=torch.uint8)
    lens = torch.tensor(lengths, device=device)
    hist = _histogram(codes, lens, C, window, cand_lo)
    for _ in range(4):
        pq_encode(
            torch.randn(B, Hkv, T, D, device=device),
            cent,
            None,
            codes,
            base=lens,
            hist=hist,
            window=window,
            cand_lo=cand_lo,
        )
        lens += T
        assert torch.equal(hist, _histogram(codes, lens, C, window, cand_lo))


def test_routing_and_workspace() -> None:
    assert ops.uses_histogram(2, 64) and ops.uses_histogram(1, 256) and not ops.uses_histogram(2, 128)
    assert ops.select_workspace_numel(32, 2, 64, 32000, 128, kept_histogram=True) == workspace_numel(
        32, 2, 64
    )
    assert ops.select_workspace_numel(32, 2, 64, 32000, 1024) == workspace_numel(32, 2, 64)
    assert ops.select_workspace_numel(32, 2, 64, 32000, 128) == tree_workspace_numel(32, 2, 64, 32000, 128)
    q = torch.empty(1, 4, 128)
    assert not ops.kernel_path(q, torch.empty(1, 1, 2, 64, 64))  # CPU tensors: the reference
    with pytest.raises(ValueError, match="C\\*\\*M"):
        pq_select_hist(
            q,
            torch.empty(1, 1, 2, 128, 64),
            torch.empty(1, 1, 8, 2, dtype=torch.uint8),
            torch.tensor([8]),
            ref.SelectParams(sink=0, window=0, heavy=1, cand_lo=0, short_threshold=1, width=1),
            positions=torch.empty(1, 4, 1, dtype=torch.int32),
            counts=torch.empty(1, 4, dtype=torch.int32),
            workspace=torch.zeros(8, dtype=torch.int32),
            n_tokens=8,
        )


def test_large_shapes_on_gpu(device: torch.device) -> None:
    """Compiled: long rows, heavy above the merge tree's limit, GQA 4, ragged."""
    if device.type != "cuda":
        pytest.skip("large shapes run compiled on the GPU")
    for maintained in (False, True):
        run_case(
            device,
            B=2,
            H=8,
            Hkv=2,
            N=200_000,
            D=128,
            M=2,
            bits=6,
            lengths=[200_000, 150_001],
            sink=128,
            window=128,
            heavy=10_000,
            init_offset=128,
            config=None,
            maintained=maintained,
            calls=3,
        )


def test_index_keeps_its_histogram(kernel_routes, device: torch.device) -> None:
    """PQIndex (histogram selection): build, appends in steps of 1 and 5, selections exact."""
    B, Hkv, H, N, D = 2, 2, 8, 3000 if device.type == "cuda" else 400, 64
    cfg = pqattn.PQConfig(subvectors=2, bits=5, sink=16, window=32, heavy=64, iters=2, share="head")
    keys = torch.randn(B, Hkv, N + 20, D, device=device)
    index = pqattn.PQIndex.build(keys[:, :, :N], [N, N - 150], capacity=N + 20, config=cfg)
    for T in (1, 5, 1, 5):
        n = index.lengths.clone()
        new = torch.randn(B, Hkv, T, D, device=device)
        index.append(new)
        want = _histogram(index.codes, index.lengths, 32, cfg.window, max(cfg.offset, cfg.sink))
        assert torch.equal(index._hist, want) and torch.equal(index.lengths, n + T)
        q = torch.randn(B, H, D, device=device)
        assert_index_selection(index, index.select(q), q)


def test_the_scan_runs_again_on_zeroed_counters(device: torch.device, monkeypatch) -> None:
    """The scan launch run again after one cut launch, its slot counters zeroed as the cut launch
    zeroes them, writes a correct selection (which of the tied tokens at the cut: the order of the
    tiles' atomics). Run again without zeroing, it writes nothing outside its rows (slots stop at
    k)."""
    import pqattn.kernels.select.hist as select_hist

    B, H, Hkv, N, D, M, C = 1, 4, 2, 3000, 32, 2, 8
    q = torch.randn(B, H, D, device=device)
    cent = torch.randn(B, Hkv, M, C, D // M, device=device).round()
    codes = torch.randint(0, C, (B, Hkv, N, M), device=device, dtype=torch.uint8)
    lens = torch.tensor([N], device=device)
    ws = torch.zeros(workspace_numel(B * H, M, C), dtype=torch.int32, device=device)
    params = ref.SelectParams(sink=4, window=4, heavy=300, cand_lo=4, short_threshold=308, width=308)
    kw = dict(workspace=ws, n_tokens=N)
    words_off = workspace_layout(B * H, M, C)[2]
    rows = torch.full((B, H, 308 + 400), -7, dtype=torch.int32, device=device)
    pos = rows[..., :308]
    cnt = torch.empty(B, H, dtype=torch.int32, device=device)
    check = dict(sink=4, window=4, heavy=300, cand_lo=4, short_threshold=308)
    pq_select_hist(q, cent, codes, lens, params, positions=pos, counts=cnt, config=SCAN_CONFIGS[0], **kw)
    assert_selection_exact(pos, cnt, None, q, cent, codes, lens, **check)
    assert (ws[words_off:].view(B * H, -1)[:, 2] > 0).all(), "the scan counted in the slot counters"

    def hook_only(*args) -> None:
        ws[words_off:].view(B * H, ROW_WORDS)[:, 2:4].zero_()

    monkeypatch.setattr(select_hist, "count_combos", lambda *a, **k: None)
    monkeypatch.setattr(select_hist, "_pq_cut_launch", hook_only)
    pos.fill_(-7)
    pq_select_hist(q, cent, codes, lens, params, positions=pos, counts=cnt, config=SCAN_CONFIGS[0], **kw)
    assert_selection_exact(pos, cnt, None, q, cent, codes, lens, **check)
    monkeypatch.setattr(select_hist, "_pq_cut_launch", lambda *a: None)
    pq_select_hist(q, cent, codes, lens, params, positions=pos, counts=cnt, config=SCAN_CONFIGS[0], **kw)
    assert (rows[..., 308:] == -7).all(), "a slot past the row's k was written"


@pytest.mark.parametrize("heavy", [STATELESS_TREE_MAX_HEAVY, STATELESS_TREE_MAX_HEAVY + 1])
def test_a_call_without_a_histogram_takes_the_cheaper_kernel(heavy: int, kernel_routes, device) -> None:
    """select_topk keeps no histogram: up to STATELESS_TREE_MAX_HEAVY it runs the merge tree, above
    it counts the histogram; a PQIndex keeps one, and its buckets, and selects from those at any
    heavy."""
    B, H, Hkv, N, D = 1, 4, 2, 1200 if device.type == "cuda" else 600, 32
    cfg = pqattn.PQConfig(subvectors=2, bits=3, sink=4, window=8, heavy=heavy, iters=1, share="head")
    keys = torch.randn(B, Hkv, N, D, device=device)
    index = pqattn.PQIndex.build(keys, capacity=N, config=cfg)
    q = torch.randn(B, H, D, device=device)
    kw = dict(sink=4, window=8, heavy=heavy, init_offset=4)
    pqattn.select_topk(q, index.centroids, index.codes, index.lengths, **kw)  # compiles, autotunes
    index.select(q)
    with recording() as rec:  # (a compiling or autotuning launch is not recorded)
        sel = pqattn.select_topk(q, index.centroids, index.codes, index.lengths, **kw)
    names = [r.launcher.fn.__name__ for r in rec.launches]
    tree = heavy <= STATELESS_TREE_MAX_HEAVY
    assert ("_pq_histogram_kernel" in names) is not tree and ("_pq_select_kernel" in names) is tree
    assert_index_selection(index, sel, q)
    with recording() as rec:
        sel = index.select(q)
    assert [r.launcher.fn.__name__ for r in rec.launches] == ["_pq_bucket_select_kernel"]
    assert_index_selection(index, sel, q)


@pytest.mark.parametrize("H,Hkv", [(4, 4), (4, 2), (8, 1)])
def test_the_scan_config_follows_the_group_size(H: int, Hkv: int, monkeypatch) -> None:
    """Without a forced config the scan runs scan_config(G): 256 tokens and 2 warps for G = 1,
    128 tokens and 1 warp with GQA. Launches intercepted, not run."""
    from pqattn.kernels.select import hist as select_hist

    grid, _, _, kwargs = select_hist_launches(monkeypatch, H, Hkv)["_pq_scan_kernel"]
    group = H // Hkv
    want = (128, 1) if group > 1 else (256, 2)
    assert (kwargs["TILE"], kwargs["num_warps"]) == want
    assert grid == (Hkv, -(-64 // want[0]))  # B = 1, N = 64 tokens
    assert select_hist.scan_config(H // Hkv) in SCAN_CONFIGS


@triton.jit
def _weighted_cut_probe(score_ptr, w_ptr, need, out_ptr, P: tl.constexpr):
    lane = tl.arange(0, P)
    score = tl.load(score_ptr + lane)
    w = tl.load(w_ptr + lane)
    cut, quota, k = weighted_cut(tl.where(w > 0, order_key(score), 0), w, need)
    tl.store(out_ptr, cut.to(tl.int32, bitcast=True))
    tl.store(out_ptr + 1, quota)
    tl.store(out_ptr + 2, k)


def _score_sets(P: int, g: torch.Generator) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """(scores, token counts): normal, and far from it."""
    normal = torch.randn(P, generator=g)
    counts = torch.randint(0, 40, (P,), generator=g)
    outliers = normal.clone()
    outliers[torch.randint(0, P, (5,), generator=g)] = 1e6
    bimodal = torch.where(torch.rand(P, generator=g) < 0.5, normal * 1e-3, normal * 1e3)
    extremes = torch.where(torch.rand(P, generator=g) < 0.5, float("-inf"), float("inf"))
    tiny = normal * 1e-40  # subnormal, and the moments underflow
    one = torch.zeros(P, dtype=torch.long)
    one[P // 3] = 1000
    return {
        "normal": (normal, counts),
        "outliers": (outliers, counts),
        "coarse": ((normal * 4).round() / 4, counts),
        "bimodal-scale": (bimodal, counts),
        "log-normal": ((normal * 3).exp(), counts),
        "all-equal": (torch.full((P,), 0.25), counts),
        "negative": (-normal.abs() - 100.0, counts),
        "signed-zeros": (torch.where(normal > 0, 0.0, -0.0), counts),
        "infinities": (extremes, counts),
        "subnormal": (tiny, counts),
        "mostly-empty": (normal, torch.where(torch.rand(P, generator=g) < 0.95, 0, counts * 1000)),
        "one-combination": (normal, one),
        "heavy-counts": (normal, torch.randint(0, 1 << 20, (P,), generator=g)),
    }


@pytest.mark.parametrize(
    "dist",
    [
        "normal",
        "outliers",
        "coarse",
        "bimodal-scale",
        "log-normal",
        "all-equal",
        "negative",
        "signed-zeros",
        "infinities",
        "subnormal",
        "mostly-empty",
        "one-combination",
        "heavy-counts",
    ],
)
@pytest.mark.parametrize("P,warps", [(16, 4), (256, 4), (1024, 4), (4096, 8)])
def test_weighted_cut_search(dist: str, P: int, warps: int, device: torch.device) -> None:
    """The weighted cut on score sets far from normal: k = min(need, tokens), the tokens of keys
    above the cut number at most k, the quota comes from the ties at the cut, and together they
    are exactly k (cut 0xFFFFFFFF and no quota when k = 0). Keys compare as the kernel orders the
    float32 scores (-0.0 below +0.0). P = 16 under 4 warps: more threads than combinations; P >=
    1024: with the normal-model first probes (one step with two probes), taken when k is at least
    1/128 of the tokens, so for most `need`."""
    g = torch.Generator().manual_seed(11)
    score, w = _score_sets(P, g)[dist]
    score = score.float()
    bits = score.view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    key = torch.where(bits >> 31 == 1, bits ^ 0xFFFFFFFF, bits | 0x80000000)
    total = int(w.sum())
    for need in sorted({0, 1, 2, 37, 128, total // 3, total - 1, total, total + 5}):
        if need < 0:
            continue
        out = torch.full((3,), -1, dtype=torch.int32, device=device)
        _weighted_cut_probe[(1,)](
            score.to(device), w.to(torch.int32).to(device), need, out, P=P, num_warps=warps
        )
        cut, quota, k = (int(x) for x in out.cpu())
        cut &= 0xFFFFFFFF
        assert k == min(need, total), (need, k)
        if k == 0:
            assert (cut, quota) == (0xFFFFFFFF, 0)
            continue
        above = int(w[key > cut].sum())
        at = int(w[key == cut].sum())
        assert 0 <= quota <= at, (need, cut, quota, at)
        assert above + quota == k, (need, above, quota, k)


@triton.jit
def _normal_probes_probe(score_ptr, w_ptr, k, total, out_ptr, P: tl.constexpr):
    lane = tl.arange(0, P)
    w = tl.load(w_ptr + lane)
    key = tl.where(w > 0, order_key(tl.load(score_ptr + lane)), 0)
    p_hi, p_lo = _normal_probes(key, w, k, total)
    tl.store(out_ptr, p_hi)
    tl.store(out_ptr + 1, p_lo)


@pytest.mark.parametrize("empty", [0.0, 0.05, 0.5], ids=lambda e: f"empty{e}")
def test_normal_probes_bracket_k(empty: float, device: torch.device) -> None:
    """On normally distributed scores, with combinations of no token among them (key 0), the two
    probes land where about k / 1.5 and 1.5 k tokens score at or above them."""
    P, k = 4096, 2048
    g = torch.Generator().manual_seed(5)
    score = torch.randn(P, generator=g)
    w = torch.randint(1, 40, (P,), generator=g) * (torch.rand(P, generator=g) >= empty)
    total = int(w.sum())
    bits = score.view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    key = torch.where(bits >> 31 == 1, bits ^ 0xFFFFFFFF, bits | 0x80000000)
    out = torch.zeros(2, dtype=torch.int64, device=device)
    _normal_probes_probe[(1,)](
        score.to(device), w.to(torch.int32).to(device), k, total, out, P=P, num_warps=8
    )
    p_hi, p_lo = (int(x) for x in out.cpu())
    at_hi, at_lo = int(w[key >= p_hi].sum()), int(w[key >= p_lo].sum())
    assert k / 3 <= at_hi < k < at_lo <= 3 * k, (at_hi, at_lo, k)
