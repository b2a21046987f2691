"""The bucket selection (PQIndex with C**M <= 4096) and the buckets it reads, against the reference.

Runs under the Triton interpreter on a CPU (small shapes) and compiled on a GPU (also large ones).
"""

from __future__ import annotations

import pytest
import torch
import triton

import pqattn
from pqattn import dispatch, ops
from pqattn import reference as ref
from pqattn.kernels.select import NewKey
from pqattn.kernels.select.buckets import (
    BUCKET_CONFIGS,
    bucket_tokens,
    pq_select_buckets,
    workspace_layout,
    workspace_numel,
)
from pqattn.kernels.select.hist import count_combos
from pqattn.runtime.launch import recording
from tests.helpers import assert_index_selection, assert_selection_exact
from tests.kernels.selection_case import SelectionCase
from tests.kernels.test_select_hist import CASES as HIST_CASES
from tests.kernels.test_select_hist import _histogram

CONFIG_IDS = [
    f"CHUNK{c.kwargs['CHUNK']}-w{c.num_warps}" + (f"-late-r{c.maxnreg}" if c.kwargs["LATE_RUNS"] else "")
    for c in BUCKET_CONFIGS
]


def _buckets(codes, lengths, C, window, cand_lo):
    """bucket_tokens into fresh buffers: (order, starts, frozen)."""
    B, Hkv, N, M = codes.shape
    dev = codes.device
    order = torch.full((B, Hkv, N), -7, dtype=torch.int32, device=dev)
    starts = torch.full((B, Hkv, C**M + 1), -7, dtype=torch.int32, device=dev)
    frozen = torch.full((B,), -7, dtype=torch.int32, device=dev)
    cursor = torch.full((B, Hkv, C**M), -7, dtype=torch.int32, device=dev)
    bucket_tokens(codes, lengths, order, starts, frozen, cursor, C=C, window=window, cand_lo=cand_lo)
    return order, starts, frozen


def assert_buckets(order, starts, frozen, codes, lengths, *, C, window, cand_lo) -> None:
    """The buckets equal the reference's, each run compared as a set (its order is arbitrary)."""
    want_order, want_starts = ref.bucket_candidates(codes, lengths, C=C, window=window, cand_lo=cand_lo)
    assert torch.equal(starts.long(), want_starts), "run starts"
    assert torch.equal(frozen.long(), (lengths.long() - window).clamp(min=cand_lo)), "frozen"
    N, P = codes.shape[2], C ** codes.shape[3]
    combo = ref.code_combinations(codes, C)

    def keys(o: torch.Tensor) -> torch.Tensor:  # combination * N + position; P * N past the runs
        inside = torch.arange(N, device=codes.device) < want_starts[..., -1:]
        return torch.where(inside, combo.gather(2, o.long().clamp(0, N - 1)) * N + o.long(), P * N)

    got = keys(order[..., :N])
    assert (got[..., 1:] // N >= got[..., :-1] // N).all(), "runs grouped by combination"
    assert torch.equal(got.sort(-1).values, keys(want_order)), "the runs' positions"


@pytest.mark.parametrize(
    "lengths, window, cand_lo", [([5000, 1234], 7, 5), ([40, 0], 0, 0), ([900, 30], 30, 3)]
)
def test_bucket_tokens(lengths: list[int], window: int, cand_lo: int, device: torch.device) -> None:
    B, Hkv, N, M, C = 2, 3, max(lengths), 2, 8
    codes = torch.randint(0, C, (B, Hkv, N, M), device=device, dtype=torch.uint8)
    lens = torch.tensor(lengths, device=device)
    order, starts, frozen = _buckets(codes, lens, C, window, cand_lo)
    assert_buckets(order, starts, frozen, codes, lens, C=C, window=window, cand_lo=cand_lo)


def run_case(device, *, recent, config, calls=2, after_encode=False, zero_programs=None, **shape) -> None:
    """Buckets built at lengths - recent (recent tokens scanned), the histogram at lengths; dense
    weights when weights_dtype is given, positions and counts of index_dtype."""
    case = SelectionCase.draw(device, **shape)
    B, H, _ = case.q.shape
    Hkv, M, C = case.centroids.shape[1], case.centroids.shape[2], case.C
    p, lens = case.params, case.lengths
    workspace = torch.zeros(workspace_numel(B * H, M, C, p.heavy), dtype=torch.int32, device=device)
    hist = torch.zeros(B, Hkv, C**M, dtype=torch.int32, device=device)
    count_combos(case.codes, lens, hist, C=C, window=p.window, cand_lo=p.cand_lo)
    buckets = _buckets(case.codes, (lens - recent).clamp(min=0), C, p.window, p.cand_lo)
    for _ in range(calls):  # later calls reuse the workspace: the kernel must leave it zero
        case.q.normal_()
        pq_select_buckets(
            case.q,
            case.centroids,
            case.codes,
            lens,
            p,
            **case.outputs(),
            workspace=workspace,
            histogram=hist,
            buckets=buckets,
            config=config,
            after_encode=after_encode,
            zero_programs=zero_programs,
        )
        case.check()
        marks_off = workspace_layout(B * H, M, C, p.heavy)[1]
        assert (workspace[marks_off:] == 0).all(), "marks zeroed"


# The histogram selection's cases (dense weights as there, and in the short and ragged case, with
# the original's int64 positions), and one whose bucketed slots span several chunks of either
# config with ties at the cut split between buckets and recent tokens.
CASES = dict(HIST_CASES)
CASES["ragged-gqa-short"] = dict(
    HIST_CASES["ragged-gqa-short"], weights_dtype=torch.float32, index_dtype=torch.int64
)
CASES["long-ties"] = dict(
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
    heavy=2500,
    init_offset=4,
    round_centroids=True,
    weights_dtype=torch.float16,
)


@pytest.mark.parametrize("recent", [0, 1, 60, 5000], ids=lambda r: f"recent{r}")
@pytest.mark.parametrize("config", BUCKET_CONFIGS, ids=CONFIG_IDS)
@pytest.mark.parametrize("case", list(CASES.values()), ids=list(CASES))
def test_select_cases(case: dict, config: triton.Config, recent: int, device: torch.device) -> None:
    run_case(device, **case, recent=recent, config=config)


@pytest.mark.parametrize("config", BUCKET_CONFIGS, ids=CONFIG_IDS)
@pytest.mark.parametrize("case", list(CASES.values()), ids=list(CASES))
def test_select_cases_after_encode(case: dict, config: triton.Config, device: torch.device) -> None:
    """Compiled with programmatic dependent launch (pqattn.kernels.pdl): the LUT and the weights'
    zeros come before the wait (under the interpreter the kernel is the one above)."""
    if device.type != "cuda":
        pytest.skip("the PDL variant is compiled on the GPU only")
    run_case(device, **case, recent=60, config=config, after_encode=True)


WEIGHTED = [name for name, case in CASES.items() if case.get("weights_dtype") is not None]


@pytest.mark.parametrize("zero_programs", [1, 3], ids=lambda z: f"zero{z}")
@pytest.mark.parametrize("config", BUCKET_CONFIGS, ids=CONFIG_IDS)
@pytest.mark.parametrize("name", WEIGHTED)
def test_zero_programs_write_the_weights(
    name: str, config: triton.Config, zero_programs: int, device: torch.device
) -> None:
    """Dense weights zeroed by other programs of the launch (shares of whole chunks, the last one
    partial or empty), the ones by whichever of a row's programs arrives last (under the
    interpreter, the last zero program; compiled, usually the selection), short rows included;
    the arrival counters left at zero (checked with the marks). With PDL on the GPU as well."""
    for after_encode in (False, True) if device.type == "cuda" else (False,):
        run_case(
            device,
            **CASES[name],
            recent=60,
            config=config,
            zero_programs=zero_programs,
            after_encode=after_encode,
        )


@pytest.mark.parametrize("recent", [0, 5000], ids=lambda r: f"recent{r}")
@pytest.mark.parametrize("heavy", [12_000, 16_500], ids=lambda h: f"heavy{h}")
@pytest.mark.parametrize("M, N", [(2, 60_000), (1, 80_000)], ids=["4x15K", "2x40K"])
def test_every_combination_tied(M: int, N: int, heavy: int, recent: int, device: torch.device) -> None:
    """Every combination at the cut (one score), quota = heavy: runs of 15K-40K tokens at the cut,
    more than the quota each, laid out after one another (the tie counts of the slot scan exceed
    16 bits)."""
    for config in (BUCKET_CONFIGS[0], BUCKET_CONFIGS[2]):
        run_case(
            device,
            B=1,
            H=2,
            Hkv=1,
            N=N,
            D=32,
            M=M,
            bits=1,
            lengths=[N],
            sink=4,
            window=8,
            heavy=heavy,
            init_offset=4,
            recent=recent,
            config=config,
            equal_centroids=True,
            calls=1,
        )


def test_large_shapes_on_gpu(device: torch.device) -> None:
    """Compiled: long rows, heavy 10K, GQA 4, ragged, a few thousand recent tokens."""
    if device.type != "cuda":
        pytest.skip("large shapes run compiled on the GPU")
    for config in BUCKET_CONFIGS:
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
            recent=3000,
            config=config,
            calls=3,
        )


@pytest.mark.parametrize("G", [1, 3], ids=["mha", "gqa"])
@pytest.mark.parametrize("zero_programs", [0, 2], ids=lambda z: f"zero{z}")
@pytest.mark.parametrize("metric", ["euclidean", "ip"])
def test_the_selection_encodes_a_new_key(
    metric: str, zero_programs: int, G: int, device: torch.device
) -> None:
    """NewKey: every call writes one new key's codes per KV head over the last n_drop rows (int64
    codes in a [B, rows, Hkv, M] buffer seen transposed, as the original's entry point keeps
    them), keeps the histogram, sets the lengths in the same launch and selects from the
    resulting codes, in long and short sequences. With zero programs for the dense weights, the
    first of each row's encodes the key, else the selection; under GQA the last of a KV head's
    rows writes the histogram's change (the counters left at zero)."""
    B, Hkv, D, M, C, cap = 2, 2, 32, 2, 8, 700
    H = Hkv * G
    sink, window, heavy, init_offset = 4, 6, 40, 4
    cand_lo, threshold = max(init_offset, sink), 20
    dsub = D // M + (metric == "ip")
    cent = torch.randn(B, Hkv, M, C, dsub, device=device)
    phi = torch.rand(B, Hkv, M, device=device) * 50 if metric == "ip" else None
    params = ref.SelectParams(
        sink, window, heavy, cand_lo, threshold, ref.selection_width(sink, window, heavy, threshold)
    )
    width = params.width
    pos = torch.empty(B, H, width, dtype=torch.int64, device=device)
    cnt = torch.empty(B, H, dtype=torch.int64, device=device)
    weights = torch.empty(B, H, cap, device=device)
    workspace = torch.zeros(workspace_numel(B * H, M, C, heavy), dtype=torch.int32, device=device)
    # 600: bucketed and recent candidates; 45: fewer candidates than heavy; 15: short
    for start, drops in ((600, (0, 1, 2, 0)), (45, (1, 0, 2)), (15, (2, 0, 1))):
        buf = torch.randint(0, C, (B, cap, Hkv, M), device=device)
        codes = buf.transpose(1, 2)  # [B, Hkv, cap, M]
        lengths = torch.full((B,), start, device=device)
        hist = _histogram(codes, lengths, C, window, cand_lo)
        buckets = _buckets(codes, (lengths - 30).clamp(min=0), C, window, cand_lo)  # later ones scanned
        for n_drop in drops:
            q = torch.randn(B, H, D, device=device)
            keys = torch.randn(B, Hkv, 1, D, device=device)
            want = codes.clone()
            row = int(lengths[0]) - n_drop
            want[:, :, row] = ref.encode(keys, cent, phi, metric)[:, :, 0]
            pq_select_buckets(
                q,
                cent,
                codes,
                lengths,
                params,
                positions=pos.fill_(-7),
                counts=cnt.fill_(-7),
                workspace=workspace,
                histogram=hist,
                buckets=buckets,
                weights=weights.fill_(float("nan")),
                new_key=NewKey(keys, phi, row + 1, n_drop),
                zero_programs=zero_programs,
            )
            assert torch.equal(codes, want), (start, n_drop)
            assert (lengths == row + 1).all(), (start, n_drop)
            assert torch.equal(hist, _histogram(codes, lengths, C, window, cand_lo)), (start, n_drop)
            assert_selection_exact(
                pos,
                cnt,
                weights,
                q,
                cent,
                codes,
                lengths,
                sink=sink,
                window=window,
                heavy=heavy,
                cand_lo=cand_lo,
                short_threshold=threshold,
            )
            marks = workspace[workspace_layout(B * H, M, C, heavy)[1] :]
            assert (marks == 0).all(), "marks and counters zeroed"
    args = dict(
        positions=pos,
        counts=cnt,
        workspace=workspace,
        histogram=hist,
        buckets=buckets,
    )
    bad = [
        (dict(new_key=NewKey(keys, phi, 20, window)), "n_drop"),
        (dict(new_key=NewKey(keys, phi, 20, 0), after_encode=True), "after_encode"),
        (dict(new_key=NewKey(keys.expand(B, Hkv, 2, D), phi, 20, 0)), r"new_key.keys"),
        (dict(new_key=NewKey(keys, phi, cap + 1, 0)), r"new_key.length"),
        (dict(new_key=NewKey(keys, phi, 0, 0)), r"new_key.length"),
        (dict(new_key=NewKey(keys, None if metric == "ip" else cent[:, :, :, 0, 0], 20, 0)), "phi"),
    ]
    for extra, match in bad:
        with pytest.raises(ValueError, match=match):
            pq_select_buckets(q, cent, codes, lengths, params, **args, **extra)


def test_routing_and_validation() -> None:
    assert ops.select_workspace_numel(32, 2, 64, 32000, 128, kept_histogram=True, buckets=True) == (
        workspace_numel(32, 2, 64, 128)
    )
    q = torch.empty(1, 4, 128)
    book = torch.empty(1, 1, 2, 64, 64), torch.empty(1, 1, 8, 2, dtype=torch.uint8), torch.tensor([8])
    with pytest.raises(ValueError, match="buckets"):
        dispatch.select(
            q,
            *book,
            ref.SelectParams(sink=0, window=0, heavy=1, cand_lo=0, short_threshold=1, width=1),
            out=None,
            workspace=None,
            buckets=(torch.empty(0), torch.empty(0), torch.empty(0)),
        )


def test_index_selects_from_its_buckets(kernel_routes, device: torch.device, monkeypatch) -> None:
    """PQIndex: one bucket launch per selection; appends (1 or 5 keys) add recent tokens until
    REINDEX_AFTER, when the buckets are rebuilt in place; every selection exact."""
    monkeypatch.setattr(pqattn.PQIndex, "REINDEX_AFTER", 6)
    B, Hkv, H, N, D = 2, 2, 8, 3000 if device.type == "cuda" else 400, 64
    cfg = pqattn.PQConfig(subvectors=2, bits=5, sink=16, window=32, heavy=64, iters=2, share="head")
    keys = torch.randn(B, Hkv, N + 40, D, device=device)
    index = pqattn.PQIndex.build(keys[:, :, :N], [N, N - 150], capacity=N + 40, config=cfg)
    order, starts, frozen = index._buckets
    kw = dict(C=32, window=cfg.window, cand_lo=max(cfg.offset, cfg.sink))
    assert_buckets(order, starts, frozen, index.codes, index.lengths, **kw)
    built_at = index.lengths.clone()
    for T in (1, 5, 1, 5):
        index.append(torch.randn(B, Hkv, T, D, device=device))
        q = torch.randn(B, H, D, device=device)
        with recording() as rec:
            sel = index.select(q)
        assert_index_selection(index, sel, q)
        if rec.launches:  # (the first call per signature records none)
            assert [r.launcher.fn.__name__ for r in rec.launches] == ["_pq_bucket_select_kernel"]
        rebuilt = not torch.equal(frozen.long(), (built_at - cfg.window).clamp(min=kw["cand_lo"]))
        if rebuilt:
            assert_buckets(order, starts, frozen, index.codes, index.lengths, **kw)
            built_at = index.lengths.clone()
        assert rebuilt == (T == 5), f"appending {T} after {index._max_length - T}"
    assert index._buckets[0] is order, "rebuilt in place"


def test_the_config_follows_the_rows(monkeypatch) -> None:
    """8 warps while every row has an SM of its own, 4 while two rows share one, 4 with a register
    cap beyond (and 4 off the GPU)."""
    import pqattn.kernels.select.buckets as select_buckets

    monkeypatch.setattr(select_buckets, "sm_count", lambda device: 4)
    cuda = torch.device("cuda")
    assert select_buckets.select_config(4, cuda) is BUCKET_CONFIGS[1]
    assert select_buckets.select_config(5, cuda) is BUCKET_CONFIGS[0]
    assert select_buckets.select_config(8, cuda) is BUCKET_CONFIGS[0]
    assert select_buckets.select_config(9, cuda) is BUCKET_CONFIGS[2]
    assert select_buckets.select_config(1, torch.device("cpu")) is BUCKET_CONFIGS[0]
