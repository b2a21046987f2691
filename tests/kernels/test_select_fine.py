"""The fine-code selection (kernels/select/fine.py) against the reference: per head and per group
(sum and max rules, G in {1, 4, 8}), ragged batches, short rows, heavy beyond the candidates,
ties, and each way the last program finishes the boundary bin (all-pairs, the kept list, a scan
of the row). Interpreter on a CPU (small shapes), compiled on a GPU (large shapes too)."""

from __future__ import annotations

import pytest
import torch

from pqattn import ops
from pqattn import reference as ref
from pqattn.kernels.select import fine
from pqattn.lab.kernel_checks import group_selection_scores, selection_problem
from pqattn.policy import lookup_tables
from pqattn.reference import SelectParams
from tests.helpers import rows_as_sets
from tests.kernels.selection_case import launch_fine_on_toy_inputs

# (TIE_TILE, BOUNDARY_CAP): the all-pairs rank, the bisection over the kept list, over the row
FINISHES = {"all-pairs": (256, 4096), "kept-list": (16, 4096), "row-scan": (16, 32)}


def _fine_case(
    device, *, B, H, Hkv, N, D, M, bits, lengths, sink, window, heavy, share, rule, shortlist=0, ties=False,
    skewed=False,
):  # fmt: skip
    """Random query, centroids and codes, the selection params, outputs pre-filled with -7, and
    a zeroed workspace with its row layout, for a fine-route call. skewed: LUT entries that rise
    with the centroid's index, codes of the upper half at the candidates the bins' sample scores
    and the lowest two elsewhere, so that t0 lies above all but sampled candidates (one full row)."""
    C = 2**bits
    q = torch.randn(B, H, D, device=device)
    cent = torch.randn(B, Hkv, M, C, D // M, device=device)
    if ties:
        q, cent = q.round(), (cent * 0.5).round()
    codes = torch.randint(0, C, (B, Hkv, N, M), dtype=torch.uint8, device=device)
    if skewed:
        q = q.abs() + 0.5
        cent = 0.1 * cent + torch.linspace(-1, 1, C, device=device)[:, None]
        tables = lookup_tables(share, rule, H // Hkv)
        sampled = fine.sample_tokens(sink, N - window - sink, fine.sample_size(M, tables)).to(device)
        high = C // 2 + codes[:, :, sampled] % (C // 2)
        codes = codes % 2
        codes[:, :, sampled] = high
    params = SelectParams.make(
        sink=sink, window=window, heavy=heavy, cand_lo=sink, short_threshold=sink + heavy + window, n_tokens=N
    )
    R = Hkv if share == "group" else H
    tables = lookup_tables(share, rule, H // Hkv)
    positions = torch.full((B, R, params.width), -7, dtype=torch.int32, device=device)
    counts = torch.full((B, R), -7, dtype=torch.int32, device=device)
    ws = torch.zeros(
        fine.workspace_numel(B * R, tables, M, C, N, shortlist), dtype=torch.int32, device=device
    )
    lay = fine.row_layout(tables, M, C, N, shortlist)
    return q, cent, codes, torch.tensor(lengths, device=device), params, positions, counts, ws, lay


def _run(
    device, *, B, H, Hkv, N, D, M, bits, lengths, sink, window, heavy, share, rule, ties=False, skewed=False,
    calls=2,
):  # fmt: skip
    """Selections of a random case against the reference; returns the reference scores [B, R, N],
    the workspace and its row layout."""
    q, cent, codes, lengths, params, positions, counts, ws, lay = _fine_case(
        device, B=B, H=H, Hkv=Hkv, N=N, D=D, M=M, bits=bits, lengths=lengths, sink=sink, window=window,
        heavy=heavy, share=share, rule=rule, ties=ties, skewed=skewed,
    )  # fmt: skip
    R = positions.shape[1]
    slack = 0.0
    if share == "group":
        scores, slack = group_selection_scores(q, cent, codes, rule)
    else:
        scores = ref.pq_scores(q.double(), cent.double(), codes)
    want = ref.select_from_scores(scores, lengths, sink=sink, window=window, heavy=heavy, init_offset=sink)
    for _ in range(calls):  # the second call reuses the workspace the first left zeroed
        fine.pq_select_fine(
            q, cent, codes, lengths, params, positions=positions, counts=counts, workspace=ws, share=share,
            group_rule=rule, tables=lookup_tables(share, rule, H // Hkv),
        )  # fmt: skip
        problem = selection_problem(
            positions, counts, scores, lengths, cand_lo=sink, window=window,
            short_threshold=params.short_threshold, ref_sel=want, slack=slack,
        )  # fmt: skip
        assert problem is None, problem
        assert not ws.view(B * R, -1)[:, lay.counters : lay.scores].any(), "counters and bins not left zeroed"
    return scores, ws, lay


@pytest.mark.parametrize("bits", [4, 8])  # max-rule tables gathered from registers (C <= 32), from memory
@pytest.mark.parametrize("finish", FINISHES)
@pytest.mark.parametrize("share,rule", [("head", "sum"), ("group", "sum"), ("group", "max")])
def test_fine_selection_matches_reference(device, monkeypatch, finish, share, rule, bits):
    monkeypatch.setattr(fine, "TIE_TILE", FINISHES[finish][0])
    monkeypatch.setattr(fine, "BOUNDARY_CAP", FINISHES[finish][1])
    _run(
        device, B=2, H=8 if share == "group" else 4, Hkv=2, N=2500, D=32, M=4, bits=bits,
        lengths=[2500, 1300], sink=4, window=16, heavy=90, share=share, rule=rule,
    )  # fmt: skip


@pytest.mark.parametrize("bits", [4, 8])
def test_fine_max_rule_of_a_group_not_a_power_of_two(device, bits):
    """G = 3: the max rule's tables padded to 4 a code, the padding's entries never the max. Heavy
    is all but 9% of the long row's candidates: its boundary falls among maxima below zero (all
    three heads' sums negative: about 1 token in 8)."""
    _run(
        device, B=2, H=6, Hkv=2, N=2100, D=32, M=4, bits=bits, lengths=[2100, 1500], sink=4, window=16,
        heavy=1900, share="group", rule="max",
    )  # fmt: skip


@pytest.mark.parametrize(
    "score_elements,kth_chunk,rank_chunk,block_n,steps,per_sm",
    [(256, 256, 8, 256, 2, 3), (1 << 14, 4096, 256, 1024, 3, 1)],  # (the defaults run in every other test)
    ids=["small-programs", "whole-tiles"],
)
@pytest.mark.parametrize("share,rule", [("head", "sum"), ("group", "max")])
def test_fine_launch_tilings(
    device, monkeypatch, score_elements, kth_chunk, rank_chunk, block_n, steps, per_sm, share, rule
):
    """The score launch's codes per step and programs a row, the boundary-bin search's count
    tiles, the all-pairs rank's column tiles and the collect's blocks per program (the last
    program's partly past the row) change how the work is cut, never the selection."""
    monkeypatch.setattr(fine, "SCORE_PROGRAMS_PER_SM", per_sm)
    monkeypatch.setattr(fine, "SCORE_ELEMENTS", score_elements)
    monkeypatch.setattr(fine, "REG_LUT_ELEMENTS", score_elements)
    monkeypatch.setattr(fine, "KTH_CHUNK", kth_chunk)
    monkeypatch.setattr(fine, "RANK_CHUNK", rank_chunk)
    monkeypatch.setattr(fine, "BLOCK_N", block_n)
    monkeypatch.setattr(fine, "collect_programs", lambda blocks, rows, sms: -(-blocks // steps))
    _run(
        device, B=2, H=4, Hkv=2, N=1200, D=32, M=4, bits=4, lengths=[1200, 900], sink=4, window=16,
        heavy=60, share=share, rule=rule, ties=rule == "max", calls=1,
    )  # fmt: skip


@pytest.mark.parametrize("share,rule", [("head", "sum"), ("group", "max")])
def test_fine_rows_far_shorter_than_the_token_axis(device, monkeypatch, share, rule):
    """A token axis four times the rows' lengths (an index's capacity): the score programs split
    the row's candidates, not the axis, several steps each, and the collect's programs split the
    row's blocks, four each; the selection is the reference's."""
    monkeypatch.setattr(fine, "SCORE_ELEMENTS", 256)
    monkeypatch.setattr(fine, "SCORE_PROGRAMS_PER_SM", 1)
    monkeypatch.setattr(fine, "BLOCK_N", 256)
    monkeypatch.setattr(fine, "collect_programs", lambda blocks, rows, sms: 2)
    _run(
        device, B=1, H=4, Hkv=2, N=8000, D=32, M=4, bits=8, lengths=[2000], sink=4, window=16,
        heavy=120, share=share, rule=rule, calls=1,
    )  # fmt: skip


@pytest.mark.parametrize("finish", FINISHES)
def test_fine_selection_ties(device, monkeypatch, finish):
    monkeypatch.setattr(fine, "TIE_TILE", FINISHES[finish][0])
    monkeypatch.setattr(fine, "BOUNDARY_CAP", FINISHES[finish][1])
    _run(
        device, B=1, H=4, Hkv=2, N=3000, D=16, M=4, bits=4, lengths=[3000], sink=2, window=8, heavy=400,
        share="head", rule="sum", ties=True,
    )  # fmt: skip


@pytest.mark.parametrize(
    "G,bits,rule",
    # max rule: G tables side by side in the LUT, a vector load a code (G = 3: a padded, masked
    # vector; C <= 32: gathered from registers)
    [(1, 6, "sum"), (8, 5, "sum"), (2, 6, "max"), (3, 6, "max"), (3, 4, "max"), (4, 4, "max"), (8, 6, "max")],
)
def test_fine_group_sizes_short_rows_and_heavy_beyond_candidates(device, G, bits, rule):
    # lengths: a full row, a short row (n <= sink + heavy + window), one with heavy beyond its
    # candidates is short by the native rule, so heavy > candidates shows with cand_lo > sink
    _run(
        device, B=3, H=2 * G, Hkv=2, N=1200, D=16, M=8, bits=bits, lengths=[1200, 150, 0], sink=8,
        window=32, heavy=100, share="group", rule=rule,
    )  # fmt: skip


@pytest.mark.parametrize("finish", FINISHES)
@pytest.mark.parametrize("share,rule", [("head", "sum"), ("group", "max")])
def test_fine_bins_start_above_the_needed_scores(device, monkeypatch, finish, share, rule):
    """A sample of candidates far from the row (skewed codes) puts the bins' start t0 above all but
    a few of the sampled scores, fewer than need: the boundary is then the bin below t0, and the
    selection stays exact."""
    monkeypatch.setattr(fine, "TIE_TILE", FINISHES[finish][0])
    monkeypatch.setattr(fine, "BOUNDARY_CAP", FINISHES[finish][1])
    N, sink, window, heavy = 2500, 4, 16, 150
    # bits 6: memory gathers, which sample (register-LUT programs bin every score)
    scores, ws, lay = _run(
        device, B=1, H=8, Hkv=2, N=N, D=32, M=4, bits=6, lengths=[N], sink=sink, window=window,
        heavy=heavy, share=share, rule=rule, skewed=True,
    )  # fmt: skip
    t0 = ws.view(torch.float32).view(scores.shape[1], -1)[:, lay.pq_bins]
    reaching = (scores[0, :, sink : N - window] >= t0[:, None].double()).sum(-1)
    assert (reaching < heavy).all(), reaching


@pytest.mark.parametrize("C", [16, 256])
def test_fine_code_base_and_init_offset(device, C):
    """Codes that start at init_offset (the original's codebook) and a candidate range that starts
    past the sink: heavy may exceed the candidates of a row that is not short."""
    B, H, Hkv, N, D, M = 1, 4, 2, 900, 16, 4
    base, sink, window, heavy = 40, 8, 16, 360
    q = torch.randn(B, H, D, device=device)
    cent = torch.randn(B, Hkv, M, C, D // M, device=device)
    codes = torch.randint(0, C, (B, Hkv, N - base, M), dtype=torch.uint8, device=device)
    lengths = torch.tensor([400], device=device)  # short threshold 8 + 360 + 16 = 384 < 400
    params = SelectParams.make(
        sink=sink, window=window, heavy=heavy, cand_lo=base, short_threshold=sink + heavy + window, n_tokens=N
    )
    positions = torch.full((B, H, params.width), -7, dtype=torch.int32, device=device)
    counts = torch.full((B, H), -7, dtype=torch.int32, device=device)
    ws = torch.zeros(fine.workspace_numel(B * H, 1, M, C, N), dtype=torch.int32, device=device)
    fine.pq_select_fine(
        q,
        cent,
        codes,
        lengths,
        params,
        positions=positions,
        counts=counts,
        workspace=ws,
        n_tokens=N,
        code_base=base,
    )
    full = torch.zeros(B, Hkv, N, M, dtype=torch.uint8, device=device)
    full[:, :, base:] = codes
    scores = ref.pq_scores(q.double(), cent.double(), full)
    want = ref.select_from_scores(scores, lengths, sink=sink, window=window, heavy=heavy, init_offset=base)
    assert int(counts[0, 0]) == sink + (400 - window - base) + window  # every candidate
    problem = selection_problem(
        positions, counts, scores, lengths, cand_lo=base, window=window,
        short_threshold=params.short_threshold, ref_sel=want,
    )  # fmt: skip
    assert problem is None, problem


@pytest.mark.parametrize("metric", ["euclidean", "ip"])
@pytest.mark.parametrize(
    "share,rule,store,bits,form",
    [
        ("group", "max", True, 8, "keys"),
        ("group", "max", False, 4, "keys"),
        ("head", "sum", True, 8, "keys"),
        ("group", "max", False, 8, "cache"),
        ("head", "sum", False, 8, "cache"),
    ],
)
def test_fine_lut_launch_encodes_the_appended_key(device, metric, share, rule, store, bits, form):
    """AppendedKey: the LUT launch does the encode launch's work. Against pq_encode then the
    selection on a copy of the state, three steps of ragged sequences: the new key's codes (the
    reference's), the cache rows (float32 keys into a bf16 cache), the lengths advanced once, the
    arrival counters back at zero, and the same selection (it sees the advanced lengths). form
    "cache": the key read from row lengths[b] of a key cache written first (at_length)."""
    from pqattn.kernels.encode import pq_encode
    from pqattn.kernels.select import AppendedKey

    B, H, Hkv, N, D, M = 2, 8, 2, 160, 32, 4
    C, dsub = 2**bits, D // M + (metric == "ip")
    sink, window, heavy = 4, 8, 10
    cent = torch.randn(B, Hkv, M, C, dsub, device=device)
    phi = torch.rand(B, Hkv, M, device=device) * 50 if metric == "ip" else None
    codes = torch.randint(0, C, (B, Hkv, N, M), dtype=torch.uint8, device=device)
    lengths = torch.tensor([100, 61], device=device)
    k_cache = torch.full((B, Hkv, N, D), float("nan"), dtype=torch.bfloat16, device=device)
    v_cache = torch.full((B, Hkv, N, D), float("nan"), dtype=torch.float32, device=device)
    state = [(codes, lengths, k_cache, v_cache), tuple(t.clone() for t in (codes, lengths, k_cache, v_cache))]
    arrivals = [torch.zeros(B, dtype=torch.int32, device=device) for _ in state]
    R = Hkv if share == "group" else H
    tables = lookup_tables(share, rule, H // Hkv)
    params = SelectParams.make(
        sink=sink, window=window, heavy=heavy, cand_lo=sink, short_threshold=sink + heavy + window, n_tokens=N
    )
    ws = [
        torch.zeros(fine.workspace_numel(B * R, tables, M, C, N), dtype=torch.int32, device=device)
        for _ in state
    ]
    for _ in range(3):
        q = torch.randn(B, H, D, device=device)
        k_new = torch.randn(B, Hkv, 1, D, device=device)
        v_new = torch.randn(B, Hkv, 1, D, device=device)
        before = lengths.clone()
        if form == "cache":  # a key cache with each sequence's new key at its length, NaN elsewhere
            key_cache = torch.full((B, Hkv, N, D), float("nan"), device=device)
            for b, n in enumerate(before.tolist()):
                key_cache[b, :, n] = k_new[b, :, 0]
        sels = []
        for i, (codes_i, lengths_i, kc, vc) in enumerate(state):
            kv = (kc, vc, v_new) if store else None
            if i == 0:
                if form == "cache":
                    appended = AppendedKey(key_cache, phi, arrivals[i], kv, at_length=True)
                else:
                    appended = AppendedKey(k_new, phi, arrivals[i], kv)
            else:
                appended = None
                pq_encode(k_new, cent, phi, codes_i, base=lengths_i, kv_cache=kv, advance=arrivals[i])
            sel = (
                torch.full((B, R, params.width), -7, dtype=torch.int32, device=device),
                torch.full((B, R), -7, dtype=torch.int32, device=device),
            )
            fine.pq_select_fine(
                q, cent, codes_i, lengths_i, params, positions=sel[0], counts=sel[1], workspace=ws[i],
                share=share, group_rule=rule, tables=tables, appended=appended,
            )  # fmt: skip
            sels.append(sel)
        fused, apart = state
        assert torch.equal(lengths, before + 1) and torch.equal(apart[1], lengths)
        assert not any(a.any() for a in arrivals), "arrival counters left at zero"
        want_codes = ref.encode(k_new, cent, phi, metric)
        for b, n in enumerate(before.tolist()):
            assert torch.equal(codes[b, :, n], want_codes[b, :, 0])
        assert torch.equal(fused[0], apart[0])
        for got, want in zip(fused[2:], apart[2:], strict=True):
            assert torch.equal(got.isnan(), want.isnan()) and torch.equal(got.nan_to_num(), want.nan_to_num())
        if not store:
            assert fused[2].isnan().all(), "no cache given: none written"
        assert torch.equal(sels[0][1], sels[1][1])
        assert rows_as_sets(*sels[0]) == rows_as_sets(*sels[1])


def test_fine_appended_key_is_checked(device):
    from pqattn.kernels.select import AppendedKey

    B, H, Hkv, N, D, M, C = 1, 4, 2, 64, 32, 4, 16
    cent = torch.randn(B, Hkv, M, C, D // M, device=device)
    codes = torch.zeros(B, Hkv, N, M, dtype=torch.uint8, device=device)
    lengths = torch.tensor([40], device=device)
    arrivals = torch.zeros(B, dtype=torch.int32, device=device)
    sel = (
        torch.empty(B, Hkv, 20, dtype=torch.int32, device=device),
        torch.empty(B, Hkv, dtype=torch.int32, device=device),
    )
    ws = torch.zeros(fine.workspace_numel(B * Hkv, 2, M, C, N), dtype=torch.int32, device=device)
    q = torch.randn(B, H, D, device=device)
    cases = [
        (AppendedKey(torch.randn(B, Hkv, 2, D, device=device), None, arrivals, None), 4, "appended.keys"),
        (AppendedKey(torch.randn(B, Hkv, 1, D, device=device), None, arrivals.long(), None), 4, "arrivals"),
        (
            AppendedKey(torch.randn(B, Hkv, 1, D, device=device), torch.ones(B, Hkv, M), arrivals, None),
            4,
            "phi",
        ),
        (AppendedKey(torch.randn(B, Hkv, 1, D, device=device), None, arrivals, None), 0, "window"),
        (
            AppendedKey(torch.randn(B, Hkv, N - 1, D, device=device), None, arrivals, None, True),
            4,
            "key cache",
        ),
    ]
    for appended, window, message in cases:
        params = SelectParams.make(
            sink=4, window=window, heavy=20 - 4 - window, cand_lo=4, short_threshold=20, n_tokens=N
        )
        with pytest.raises(ValueError, match=message):
            fine.pq_select_fine(
                q, cent, codes, lengths, params, positions=sel[0], counts=sel[1], workspace=ws, share="group",
                group_rule="max", tables=2, appended=appended,
            )  # fmt: skip
    assert lengths.tolist() == [40] and not codes.any(), "a refused call writes nothing"


@pytest.mark.parametrize("share,rule,tables", [("group", "max", 1), ("group", "sum", 4), ("head", "sum", 4)])
def test_fine_launch_refuses_tables_its_rule_does_not_use(share, rule, tables):
    """The LUT launch's grid holds lookup_tables(share, rule, G) tables a row: another count is
    refused before anything is launched."""
    with pytest.raises(ValueError, match="tables: expected"):
        launch_fine_on_toy_inputs(share, rule, tables, H=8)


def test_fine_collect_programs() -> None:
    """COLLECT_PROGRAMS_PER_SM collect programs a SM over all rows, at least one a row and at most
    one a block; the room past the rows (more blocks) does not change the count."""
    per_sm = fine.COLLECT_PROGRAMS_PER_SM
    assert fine.collect_programs(40, 256, 132) == 132 * per_sm // 256
    assert fine.collect_programs(33, 256, 132) == fine.collect_programs(40, 256, 132)
    assert fine.collect_programs(40, 8, 132) == 40 and fine.collect_programs(136, 8, 132) == 132 * per_sm // 8
    assert fine.collect_programs(40, 132 * per_sm + 1, 132) == 1
    assert fine.collect_programs(0, 1, 132) == 1


def test_fine_rerank_collects_several_blocks_a_program(device, monkeypatch):
    """Both collects of a re-rank (the tokens into the shortlist, the shortlist into the output)
    with three blocks a program, past the row's end in the last."""
    monkeypatch.setattr(fine, "BLOCK_N", 256)
    monkeypatch.setattr(fine, "collect_programs", lambda blocks, rows, sms: -(-blocks // 3))
    _rerank_case(
        device, B=2, H=8, Hkv=2, N=1500, D=32, M=4, bits=8, lengths=[1500, 700], sink=4, window=16,
        heavy=60, rerank=4, share="group", rule="max", ties=False,
    )  # fmt: skip


@pytest.mark.skipif(not torch.cuda.is_available(), reason="full shapes on the GPU")
@pytest.mark.parametrize("share,rule", [("head", "sum"), ("group", "sum"), ("group", "max")])
@pytest.mark.parametrize("M,bits", [(16, 8), (32, 4)])
@pytest.mark.parametrize("B,N,heavy", [(1, 131072, 2621), (4, 32768, 2621), (1, 200_000, 8000)])
def test_fine_selection_full_shapes_cuda(share, rule, B, N, heavy, M, bits):
    _run(
        torch.device("cuda"), B=B, H=32, Hkv=8, N=N, D=128, M=M, bits=bits,
        lengths=[N - 7 * b for b in range(B)], sink=64, window=64, heavy=heavy, share=share, rule=rule,
    )  # fmt: skip


def test_ops_group_selection_and_decode(device, kernel_routes):
    """The public route: select_topk(share="group") and sparse_decode over the shared rows, into
    kept buffers (a plan replayed on the second call), against the references. heavy counts
    tokens per query head: a group row keeps G x heavy by default, group_budget x heavy else."""
    B, H, Hkv, N, D = 2, 8, 2, 1500, 32
    keys = torch.randn(B, Hkv, N, D, device=device)
    values = torch.randn(B, Hkv, N, D, device=device)
    q = torch.randn(B, H, D, device=device)
    book = ops.build_index(keys, bits=8, subvectors=4, init_offset=4, iters=2)
    lengths = torch.tensor([1500, 700], device=device)
    sizes = dict(sink=4, window=16, heavy=16, init_offset=4, share="group", group_rule="max")
    assert ops.kernel_path(q, book.centroids, 64, "group")
    one = ops.select_topk(q, book.centroids, book.codes, lengths, **sizes, group_budget=1.0)
    assert one.positions.shape == (B, Hkv, 4 + 16 + 16)
    width = 4 + 64 + 16
    out = ref.Selection(
        torch.full((B, Hkv, width), -7, dtype=torch.int32, device=device),
        torch.zeros(B, Hkv, dtype=torch.int32, device=device),
    )
    ws = torch.zeros(
        ops.select_workspace_numel(B * Hkv, 4, 256, N, 64, share="group", tables=H // Hkv),
        dtype=torch.int32,
        device=device,
    )
    want = ref.select_pq(q, book.centroids, book.codes, lengths, **(sizes | {"heavy": 64}))
    scores, slack = group_selection_scores(q, book.centroids, book.codes, "max")
    dec_ws = torch.zeros(
        ops.decode_workspace_numel(B * Hkv, width, D, group=H // Hkv), dtype=torch.int32, device=device
    )
    o = torch.full((B, H, D), float("nan"), device=device)
    for _ in range(2):
        sel = ops.select_topk(q, book.centroids, book.codes, lengths, out=out, workspace=ws, **sizes)
        problem = selection_problem(
            *sel, scores, lengths, cand_lo=4, window=16, short_threshold=width, ref_sel=want, slack=slack
        )
        assert problem is None, problem
        ops.sparse_decode(q, keys, values, sel.positions, sel.counts, out=o, workspace=dec_ws)
        expect = ref.sparse_decode(
            q, keys, values, sel.positions.repeat_interleave(4, 1), sel.counts.repeat_interleave(4, 1), None
        )
        torch.testing.assert_close(o, expect, atol=1e-4, rtol=1e-4)


def test_select_topk_share_arguments_are_checked(device):
    q = torch.randn(1, 4, 16, device=device)
    keys = torch.randn(1, 2, 64, 16, device=device)
    book = ops.build_index(keys, bits=2, subvectors=2, iters=1)
    args = (q, book.centroids, book.codes, torch.tensor([64], device=device))
    sizes = dict(sink=2, window=4, heavy=8)
    with pytest.raises(ValueError, match="share"):
        ops.select_topk(*args, share="heads", **sizes)
    with pytest.raises(ValueError, match="group_rule"):
        ops.select_topk(*args, share="group", group_rule="mean", **sizes)
    with pytest.raises(ValueError, match="rerank"):
        ops.select_topk(*args, rerank=-1, **sizes)
    with pytest.raises(ValueError, match="keys"):
        ops.select_topk(*args, rerank=2, **sizes)


def _rerank_case(
    device, *, B, H, Hkv, N, D, M, bits, lengths, sink, window, heavy, rerank, share, rule, ties=False
):
    keys = torch.randn(B, Hkv, N, D, device=device)
    q, cent, codes, lengths, params, positions, counts, ws, lay = _fine_case(
        device, B=B, H=H, Hkv=Hkv, N=N, D=D, M=M, bits=bits, lengths=lengths, sink=sink, window=window,
        heavy=heavy, share=share, rule=rule, shortlist=rerank * heavy,
    )  # fmt: skip
    if ties:  # integer exact scores over few values: boundary bins of many tied entries
        q, keys = q.round(), (keys * 0.3).round()
    R = positions.shape[1]
    exact = ref.exact_scores(q.double(), keys.double())
    slack = 0.0
    if share == "group":
        (pq, slack), exact = group_selection_scores(q, cent, codes, rule), ref.group_scores(exact, Hkv, rule)
    else:
        pq = ref.pq_scores(q.double(), cent.double(), codes)
    sizes = dict(sink=sink, window=window, init_offset=sink)
    for _ in range(2):
        fine.pq_select_fine(
            q, cent, codes, lengths, params, positions=positions, counts=counts, workspace=ws, share=share,
            group_rule=rule, tables=lookup_tables(share, rule, H // Hkv), rerank=rerank, keys=keys,
        )  # fmt: skip
        # the shortlist: the kernel's own (PQ ties at its cut may go either way), checked as a
        # PQ top-k; then the heavy part: the exact top-heavy within it
        short = ws.view(B * R, -1)[:, lay.shortlist : lay.shortlist + rerank * heavy].view(B, R, -1)
        short_threshold = sink + heavy + window
        short_sel = ref.select_from_scores(
            pq, lengths, heavy=rerank * heavy, short_threshold=short_threshold, **sizes
        )
        allowed = torch.zeros(B, R, N, dtype=torch.bool, device=device)
        for b in range(B):
            n = int(lengths[b])
            if n <= sink + heavy + window:
                continue
            need = min(rerank * heavy, max(n - window - sink, 0))
            got = short[b, :, :need].long()
            want_scores = (
                pq[b].gather(-1, short_sel.positions[b, :, sink : sink + need].long()).sort(-1).values
            )
            torch.testing.assert_close(
                pq[b].gather(-1, got).sort(-1).values, want_scores, atol=1e-6 + 2 * slack, rtol=1e-6
            )
            allowed[b].scatter_(-1, got, True)
        want = ref.select_from_scores(exact, lengths, heavy=heavy, allowed=allowed, **sizes)
        # (outside the shortlist a score below every other one: finite, so the tolerance stays one)
        problem = selection_problem(
            positions, counts, exact.masked_fill(~allowed, float(exact.min()) - 1.0), lengths, cand_lo=sink,
            window=window, short_threshold=sink + heavy + window, ref_sel=want,
        )  # fmt: skip
        assert problem is None, problem
        assert not ws.view(B * R, -1)[:, lay.counters : lay.scores].any(), "counters and bins not left zeroed"


@pytest.mark.parametrize("ties", [False, True])
@pytest.mark.parametrize("finish", FINISHES)
@pytest.mark.parametrize("share,rule", [("head", "sum"), ("group", "sum"), ("group", "max")])
def test_fine_rerank_matches_reference(device, monkeypatch, finish, share, rule, ties):
    """rerank=R: the shortlist is a PQ top R * heavy, the heavy part the exact top-heavy within
    it (SPEC §7), for every way the boundary bins finish (ties fill the exact scores' boundary
    bins past the all-pairs tile); rows with R * heavy beyond their candidates, short rows and
    empty rows."""
    monkeypatch.setattr(fine, "TIE_TILE", FINISHES[finish][0])
    monkeypatch.setattr(fine, "BOUNDARY_CAP", FINISHES[finish][1])
    _rerank_case(
        device, B=3, H=8 if share == "group" else 4, Hkv=2, N=1500, D=32, M=4, bits=8,
        lengths=[1500, 300, 40], sink=4, window=16, heavy=60, rerank=4, share=share, rule=rule, ties=ties,
    )  # fmt: skip


@pytest.mark.skipif(not torch.cuda.is_available(), reason="full shapes on the GPU")
@pytest.mark.parametrize(
    "share,rule,M,bits", [("head", "sum", 16, 8), ("group", "max", 16, 8), ("head", "sum", 32, 4)]
)
def test_fine_rerank_full_shapes_cuda(share, rule, M, bits):
    _rerank_case(
        torch.device("cuda"), B=2, H=32, Hkv=8, N=131072, D=128, M=M, bits=bits, lengths=[131072, 100_000],
        sink=64, window=64, heavy=2621, rerank=4, share=share, rule=rule,
    )  # fmt: skip


def test_select_topk_rerank_through_the_api(device, kernel_routes):
    """select_topk(rerank=R) on the kernel route into kept buffers: the exact top-heavy of a PQ
    shortlist (checked through the shortlist the reference would take, away from PQ ties)."""
    B, H, Hkv, N, D = 1, 4, 2, 600, 16
    keys = torch.randn(B, Hkv, N, D, device=device)
    q = torch.randn(B, H, D, device=device)
    book = ops.build_index(keys, bits=4, subvectors=4, iters=2)
    lengths = torch.tensor([N], device=device)
    assert ops.kernel_path(q, book.centroids, 10, "head", 3)
    sel = ops.select_topk(
        q, book.centroids, book.codes, lengths, sink=2, window=4, heavy=10, rerank=3, keys=keys
    )
    scores = ref.pq_scores(q, book.centroids, book.codes)
    short = ref.select_from_scores(scores, lengths, sink=2, window=4, heavy=30)
    exact = ref.exact_scores(q, keys)
    for h in range(H):
        shortlist = set(short.positions[0, h, 2:32].tolist())
        heavy = (
            set(sel.positions[0, h, : int(sel.counts[0, h])].tolist()) - set(range(2)) - set(range(N - 4, N))
        )
        assert len(heavy) == 10
        best = sorted((float(exact[0, h, p]) for p in shortlist), reverse=True)[:10]
        got = sorted((float(exact[0, h, p]) for p in heavy), reverse=True)
        assert got == pytest.approx(best, abs=1e-5) or not heavy <= shortlist  # (a PQ tie at the cut)


@pytest.mark.parametrize("route", ["reference", "kernel"])
def test_rerank_reads_a_paged_key_cache(device, route, request):
    """rerank with keys paged behind a block table (SPEC §8) selects what it selects from the
    contiguous keys; a block table without rerank is refused."""
    if route == "kernel":
        request.getfixturevalue("kernel_routes")
    B, H, Hkv, N, D, page = 2, 4, 2, 300, 16, 16
    keys = torch.randn(B, Hkv, N, D, device=device)
    q = torch.randn(B, H, D, device=device)
    book = ops.build_index(keys, bits=4, subvectors=4, iters=2)
    lengths = torch.tensor([N, 200], device=device)
    blocks = B * -(-N // page) + 2
    table = torch.randperm(blocks)[: blocks - 2].reshape(B, -1).to(torch.int32).to(device)
    paged = ref.to_pages(keys, table, blocks, page)
    args = (q, book.centroids, book.codes, lengths)
    sizes = dict(sink=2, window=4, heavy=10, rerank=3)
    want = ops.select_topk(*args, keys=keys, **sizes)
    got = ops.select_topk(*args, keys=paged, block_table=table, **sizes)
    assert torch.equal(got.counts, want.counts)
    for b in range(B):
        for h in range(H):
            n = int(want.counts[b, h])
            assert sorted(got.positions[b, h, :n].tolist()) == sorted(want.positions[b, h, :n].tolist())
    with pytest.raises(ValueError, match="block_table: expected None without rerank"):
        ops.select_topk(*args, sink=2, window=4, heavy=10, block_table=table)
    with pytest.raises(ValueError, match="keys: expected a paged cache"):
        ops.select_topk(*args, keys=paged[:, :, :1], block_table=table, **sizes)
