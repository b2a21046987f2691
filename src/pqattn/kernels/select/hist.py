"""PQ top-k selection through the histogram of code combinations (SPEC §2), when C**M <= 4096.

A token's approximate score depends only on its code combination (c_0, ..., c_{M-1}), so with
P = C**M <= MAX_COMBOS combinations a row's scores take at most P values, and how many candidate
tokens carry each combination (the histogram of a sequence and KV head) does not depend on the
query. The exact top-k threshold is then a search over P weighted values instead of N scores,
and the tokens need a single pass that compares, with no search:
  1. `_pq_histogram_kernel` (only when the caller keeps no histogram): every candidate token
     [cand_lo, n - window) adds one to its combination's count, per (sequence, KV head). PQIndex
     keeps its histogram current as keys are appended (pq_encode) and skips this launch.
  2. `_pq_cut_kernel`, one program per (sequence, query head): the LUT, the score of every
     combination, and a weighted search for the cut: every combination scoring above it is taken
     whole, plus `quota` tokens of the combination at the cut (equal scores: any of them is a
     correct choice). It leaves the LUT, the cut, k and the quota in the workspace.
  3. `_pq_scan_kernel`, one program per (sequence, KV head, tile of tokens): reads the tile's codes
     once for all query heads of the KV head, scores each token from the LUT exactly as the cut
     launch scored its combination, compares with the cut, and writes the taken positions at
     slots reserved with one atomic per tile and head (ties until the quota is met); also sink,
     window, count, -1 padding and the dense 0/1 weights.
No host sync and no allocation: the workspace is zeroed once; the cut launch zeroes its rows' slot
counters before the scan counts in them, and the scan's first tile of a (sequence, KV head) zeroes
the histogram that the cut launch consumed, so the pair can run again as it is (CUDA graph
replays). The scan alone cannot: its slot counters must be zeroed first.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pqattn.kernels.pdl import pdl_meta, release_next, wait_prior
from pqattn.kernels.select.common import (
    code_combination,
    load_codes,
    lut_base,
    order_key,
    row_need,
    weighted_cut,
    write_lut,
)
from pqattn.limits import MAX_COMBOS
from pqattn.reference.selection import SelectParams
from pqattn.runtime.launch import Launcher

ROW_WORDS = 8  # per query row: k, quota, slot counters (above, ties), the cut key, padding
_ROW_WORDS: tl.constexpr = tl.constexpr(ROW_WORDS)

# The scan's configs: tokens per program and warps. Every config is exercised by the tests and by
# `pqattn check`. A call that forces none runs `scan_config(G)`: a program's chain of dependent
# loads, a slot atomic and stores, not its bandwidth, sets the scan's time, so what counts is how
# many tokens are in flight. With G = 1 a program needs about 40 registers per thread and the
# limit of 32 programs per SM binds: 256 tokens and 2 warps. With G >= 2 a program holds G rows
# ([GP, TILE] tiles, about 90 registers per thread) and registers bind: one-warp programs of 128
# tokens keep as many tokens in flight and their rank scans and sums stay inside a warp. Not
# autotuned: timed alone, without the cut whose run its loads overlap, the scan ranks configs
# wrongly (docs/kernels/select.md).
SCAN_CONFIGS = [
    triton.Config({"TILE": tile}, num_warps=warps)
    for tile, warps in ((256, 2), (128, 1), (512, 4), (1024, 4))
]


def scan_config(G: int) -> triton.Config:
    """The scan's config for G query heads per KV head (see SCAN_CONFIGS)."""
    return SCAN_CONFIGS[1] if G > 1 else SCAN_CONFIGS[0]


HIST_TILE = 2048
CUT_WARPS = 4


def workspace_layout(rows: int, M: int, C: int) -> tuple[int, int, int, int]:
    """int32-word offsets (histogram, LUTs, row words) and the total.

    The histogram region has a row per query row (the (sequence, KV head) rows it holds are
    fewer)."""
    hist = 0
    luts = hist + rows * C**M
    words = luts + rows * M * C
    return hist, luts, words, words + rows * ROW_WORDS


def workspace_numel(rows: int, M: int, C: int) -> int:
    return workspace_layout(rows, M, C)[-1]


@triton.jit
def _pq_histogram_kernel(
    codes_ptr,
    len_ptr,
    hist_ptr,
    stride_kb,
    stride_kk,
    stride_kn,
    stride_km,
    Hkv,
    heavy,
    window,
    cand_lo,
    short_threshold,
    code_base,
    M: tl.constexpr,
    BITS: tl.constexpr,
    P: tl.constexpr,
    SKIP_SHORT: tl.constexpr,
    TILE: tl.constexpr,
):
    """hist[b * Hkv + kvh, combo] += candidate tokens of this tile carrying combo. SKIP_SHORT:
    count nothing for rows the selection will not search (short, or no heavy part)."""
    grp = tl.program_id(0)
    tile = tl.program_id(1)
    b = grp // Hkv
    kvh = grp % Hkv
    n = tl.load(len_ptr + b).to(tl.int32)
    hi, need = row_need(n, heavy, window, cand_lo)
    active = (hi > tl.maximum(cand_lo, tile * TILE)) & (cand_lo < tile * TILE + TILE)
    if SKIP_SHORT:
        active = active & (n > short_threshold) & (need > 0)
    if active:
        offs = tile * TILE + tl.arange(0, TILE)
        cand = (offs >= cand_lo) & (offs < hi)
        codes_row = codes_ptr + b * stride_kb + kvh * stride_kk - code_base * stride_kn
        combo = code_combination(load_codes(codes_row, offs, cand, stride_kn, stride_km, M), M, BITS)
        # one relaxed atomic per token: tl.histogram over P bins is slower (see docs/kernels/select.md)
        tl.atomic_add(hist_ptr + grp.to(tl.int64) * P + combo, 1, mask=cand, sem="relaxed")


@triton.jit
def _lut_and_scores(
    q_row,
    cent,
    lut_row,
    stride_cm,
    stride_cc,
    M: tl.constexpr,
    C: tl.constexpr,
    DSUB: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """Writes the LUT (the scan gathers from it) and returns the score of every combination
    [C**M], indexed as combo indexes them, in the scan's order of addition ((0 + LUT[0, c_0]) +
    LUT[1, c_1]) + ... The sums are outer sums of the LUT's rows (M * C loads instead of a gather
    per combination and m), read back from memory: the values the scan reads, to the bit (values
    kept in registers need not be: the compiler may recompute a reduction in another layout, in
    another order)."""
    write_lut(q_row, cent, lut_row, stride_cm, stride_cc, M, C, DSUB, BLOCK_D)
    tl.debug_barrier()  # the other threads' LUT stores are visible after it
    c_idx = tl.arange(0, C)
    score = 0.0 + tl.load(lut_row + c_idx)
    for m in tl.static_range(1, M):
        lut = tl.load(lut_row + m * C + c_idx)
        score = tl.reshape(score[:, None] + lut[None, :], [C ** (m + 1)])
    return score


@triton.jit
def _pq_cut_kernel(
    q_ptr,
    cent_ptr,
    len_ptr,
    hist_ptr,
    ws_ptr,
    stride_qb,
    stride_qh,
    stride_cb,
    stride_ck,
    stride_cm,
    stride_cc,
    H,
    G,
    heavy,
    window,
    cand_lo,
    short_threshold,
    lut_off,
    words_off,
    M: tl.constexpr,
    C: tl.constexpr,
    P: tl.constexpr,
    DSUB: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PDL: tl.constexpr,
):
    row = tl.program_id(0)
    b = row // H
    h = row % H
    kvh = h // G
    words = ws_ptr + words_off + row * _ROW_WORDS
    wait_prior(PDL)
    release_next(PDL)  # the scan's programs start and load their codes while this launch runs
    # the scan's slot counters of this row start at zero (under PDL the scan's programs start
    # during this launch, but count only after their wait for its end)
    tl.store(words + 2 + tl.arange(0, 2), tl.zeros([2], tl.int32))
    n = tl.load(len_ptr + b).to(tl.int32)
    if n > short_threshold:
        _, need = row_need(n, heavy, window, cand_lo)
        combo = tl.arange(0, P)
        w = tl.load(hist_ptr + (row // G).to(tl.int64) * P + combo)  # in flight with the LUT's loads
        score = _lut_and_scores(
            q_ptr + b * stride_qb + h * stride_qh,
            cent_ptr + b * stride_cb + kvh * stride_ck,
            lut_base(ws_ptr) + lut_off + row * (M * C),
            stride_cm,
            stride_cc,
            M,
            C,
            DSUB,
            BLOCK_D,
        )
        key = tl.where(w > 0, order_key(score), 0)
        cut, quota, k = weighted_cut(key, w, need)
        tl.store(words, k)
        tl.store(words + 1, quota)
        tl.store(words + 4, cut.to(tl.int32, bitcast=True))


@triton.jit
def _pq_scan_kernel(
    codes_ptr,
    len_ptr,
    hist_ptr,
    ws_ptr,
    pos_ptr,
    cnt_ptr,
    w_ptr,
    stride_kb,
    stride_kk,
    stride_kn,
    stride_km,
    stride_pb,
    stride_ph,
    stride_wb,
    stride_wh,
    H,
    G,
    Hkv,
    n_weights,
    sink,
    window,
    heavy,
    cand_lo,
    short_threshold,
    width,
    code_base,
    lut_off,
    words_off,
    M: tl.constexpr,
    C: tl.constexpr,
    P: tl.constexpr,
    GP: tl.constexpr,
    HAS_W: tl.constexpr,
    CONSUME_HIST: tl.constexpr,
    TILE: tl.constexpr,
    PDL: tl.constexpr,
):
    grp = tl.program_id(0)  # b * Hkv + kvh
    tile = tl.program_id(1)
    n_tiles = tl.num_programs(1)
    b = grp // Hkv
    kvh = grp % Hkv
    n = tl.load(len_ptr + b).to(tl.int32)
    lane = tl.arange(0, TILE)
    offs = tile * TILE + lane
    one = tl.full([TILE], 1.0, tl.float32)
    hi, need = row_need(n, heavy, window, cand_lo)
    tile_has = (
        (n > short_threshold)
        & (need > 0)
        & (tl.minimum(hi, tile * TILE + TILE) > tl.maximum(cand_lo, tile * TILE))
    )
    # (a block & a scalar bool would be int32 under Triton 3.9's interpreter)
    cand = (offs >= cand_lo) & (offs < tl.where(tile_has, hi, cand_lo))
    codes_row = codes_ptr + b * stride_kb + kvh * stride_kk - code_base * stride_kn
    # The codes and lengths are loaded before the wait: the cut launch, the one before this,
    # writes neither (pqattn.kernels.pdl), so under PDL these loads overlap the cut.
    code = load_codes(codes_row, offs, cand, stride_kn, stride_km, M)
    wait_prior(PDL)
    release_next(PDL)
    if n <= short_threshold:  # short sequence: every token, as in pqattn.kernels.select
        for gi in range(G):
            hh = kvh * G + gi
            pos_row = pos_ptr + b * stride_pb + hh * stride_ph
            tl.store(pos_row + offs, tl.where(offs < n, offs, -1), mask=offs < width)
            if tile == n_tiles - 1:
                for start in range(n_tiles * TILE, width, TILE):
                    tail = start + lane
                    tl.store(pos_row + tail, tl.full([TILE], -1, tl.int32), mask=tail < width)
                tl.store(cnt_ptr + b * H + hh, n)
            if HAS_W:
                w_row = w_ptr + b * stride_wb + hh * stride_wh
                tl.store(
                    w_row + offs,
                    tl.where(offs < n, one, 0.0).to(w_ptr.dtype.element_ty),
                    mask=offs < n_weights,
                )
    else:
        n_sink = tl.minimum(sink, n)
        win_lo = tl.maximum(hi, n_sink)
        n_win = n - win_lo
        keep = (offs < n_sink) | ((offs >= win_lo) & (offs < n))
        # The group's query heads side by side ([GP, TILE]): their slot atomics go out together
        # instead of one round trip after another.
        g = tl.arange(0, GP)
        g_ok = g < G
        h = kvh * G + g
        words = ws_ptr + words_off + (b * H + h) * _ROW_WORDS
        k = tl.load(words, mask=g_ok, other=0)
        quota = tl.load(words + 1, mask=g_ok, other=0)
        cut = tl.load(words + 4, mask=g_ok, other=-1).to(tl.uint32, bitcast=True)
        take = (offs[None, :] < 0) & g_ok[:, None]
        if tile_has:
            # Each token's score from its head's LUT, summed in the cut launch's order, so that
            # it is bit for bit the score the cut was chosen among. (The LUT is a few cache lines;
            # a table per combination was not: its gathers spread over many more lines.)
            lut = lut_base(ws_ptr) + lut_off + (b * H + h) * (M * C)
            ok = g_ok[:, None] & cand[None, :]
            m_idx = tl.arange(0, M)
            score = tl.zeros([GP, TILE], tl.float32)
            for m in tl.static_range(M):
                code_m = tl.sum(tl.where(m_idx[None, :] == m, code, 0), axis=1)
                score += tl.load(lut[:, None] + m * C + code_m[None, :], mask=ok, other=0.0)
            key = order_key(score)
            above = ok & (key > cut[:, None])
            tie = ok & (key == cut[:, None]) & (quota > 0)[:, None]
            packed = above.to(tl.int32) + (tie.to(tl.int32) << 16)  # both ranks in one scan
            inclusive = tl.cumsum(packed, 1)
            total = tl.sum(packed, 1)
            n_above = total & 0xFFFF
            n_tie = total >> 16
            base_above = tl.atomic_add(words + 2, n_above, mask=n_above > 0, sem="relaxed")
            base_tie = tl.atomic_add(words + 3, n_tie, mask=(n_tie > 0) & (quota > 0), sem="relaxed")
            tie_rank = base_tie[:, None] + (inclusive >> 16) - 1
            take_tie = tie & (tie_rank < quota[:, None])
            slot = tl.where(
                above, base_above[:, None] + (inclusive & 0xFFFF) - 1, (k - quota)[:, None] + tie_rank
            )
            # (slot < k holds after the cut launch; a scan run without it stays inside the row)
            take = (above | take_tie) & (slot < k[:, None])
            pos = pos_ptr + b * stride_pb + h[:, None] * stride_ph + n_sink + slot
            tl.store(pos, tl.zeros([GP, TILE], tl.int32) + offs[None, :], mask=take)
        if HAS_W:
            w_rows = w_ptr + b * stride_wb + h[:, None] * stride_wh + offs[None, :]
            value = tl.where(keep[None, :] | take, 1.0, 0.0).to(w_ptr.dtype.element_ty)
            tl.store(w_rows, value, mask=g_ok[:, None] & (offs < n_weights)[None, :])
        if tile == 0:
            # sink, window, count and -1 padding of the group's rows, from the k the cut left
            rows = pos_ptr + b * stride_pb + h[:, None] * stride_ph
            for start in range(0, n_sink, TILE):
                o = start + lane
                tl.store(
                    rows + o[None, :],
                    tl.zeros([GP, TILE], tl.int32) + o[None, :],
                    mask=g_ok[:, None] & (o < n_sink)[None, :],
                )
            for start in range(0, n_win, TILE):
                o = start + lane
                tl.store(
                    rows + n_sink + k[:, None] + o[None, :],
                    tl.zeros([GP, TILE], tl.int32) + (win_lo + o)[None, :],
                    mask=g_ok[:, None] & (o < n_win)[None, :],
                )
            count = n_sink + k + n_win
            for start in range(n_sink + n_win, width, TILE):
                o = (start + lane)[None, :] + k[:, None]
                tl.store(rows + o, tl.full([GP, TILE], -1, tl.int32), mask=g_ok[:, None] & (o < width))
            tl.store(cnt_ptr + b * H + h, count, mask=g_ok)
            if CONSUME_HIST:  # the cut launch has read it: zero for the next call
                for start in range(0, P, TILE):
                    o = start + lane
                    tl.store(hist_ptr + grp.to(tl.int64) * P + o, tl.zeros([TILE], tl.int32), mask=o < P)


_pq_scan_launch = Launcher(_pq_scan_kernel)
_pq_cut_launch = Launcher(_pq_cut_kernel)
_pq_histogram_launch = Launcher(_pq_histogram_kernel)


def count_combos(
    codes: torch.Tensor,
    lengths: torch.Tensor,
    hist: torch.Tensor,
    *,
    C: int,
    window: int,
    cand_lo: int,
    heavy: int = 1,
    short_threshold: int = -1,
    code_base: int = 0,
    skip_short: bool = False,
) -> None:
    """Add the combination counts of the candidate tokens [cand_lo, n - window) to hist.

    codes [B, Hkv, N, M] by strides (row r: token code_base + r); hist int32 with a contiguous
    row of C**M counts per (b, kvh), zero where nothing was counted yet."""
    B, Hkv, N, M = codes.shape
    N += code_base
    grid = (B * Hkv, max(-(-N // HIST_TILE), 1))
    _pq_histogram_launch(
        grid,
        (codes, lengths, hist),
        (*codes.stride(), Hkv, heavy, window, cand_lo, short_threshold, code_base),
        dict(M=M, BITS=C.bit_length() - 1, P=C**M, SKIP_SHORT=skip_short, TILE=HIST_TILE, num_warps=4),
    )


def pq_select_hist(
    q: torch.Tensor,
    centroids: torch.Tensor,
    codes: torch.Tensor,
    lengths: torch.Tensor,
    params: SelectParams,
    *,
    positions: torch.Tensor,
    counts: torch.Tensor,
    workspace: torch.Tensor,
    n_tokens: int,
    histogram: torch.Tensor | None = None,
    weights: torch.Tensor | None = None,
    code_base: int = 0,
    config: triton.Config | None = None,
) -> None:
    """Launch the histogram selection on validated inputs (arguments as pqattn.kernels.select.tree.pq_select).

    histogram: [B, Hkv, C**M] int32 counts of the candidate tokens [cand_lo, n - window) per
    combination for the current lengths (PQIndex keeps one); None counts them into the workspace
    first (one more launch). workspace: int32, zero-filled once, workspace_numel(B * H, M, C)
    elements. `config`: one of SCAN_CONFIGS for the scan (by default `scan_config(G)`).
    """
    sink, window, heavy, cand_lo, short_threshold, width = params
    B, H, D = q.shape
    Hkv, M, C = centroids.shape[1], centroids.shape[2], centroids.shape[3]
    if C**M > MAX_COMBOS:
        raise ValueError(f"centroids: the histogram selection needs C**M <= {MAX_COMBOS}, got C={C}, M={M}")
    rows = B * H
    _, lut_off, words_off, _ = workspace_layout(rows, M, C)
    need = workspace_numel(rows, M, C)
    if workspace.dtype != torch.int32 or workspace.numel() < need:
        raise ValueError(
            f"workspace: expected int32 with at least {need} elements, got {workspace.dtype} "
            f"with {workspace.numel()}"
        )
    if config is not None and config not in SCAN_CONFIGS:
        raise ValueError("config: expected one of SCAN_CONFIGS")
    G = H // Hkv
    if config is None:
        config = scan_config(G)
    consume = histogram is None
    if consume:
        histogram = workspace  # its histogram region opens it
        count_combos(
            codes,
            lengths,
            workspace,
            C=C,
            window=window,
            cand_lo=cand_lo,
            heavy=heavy,
            short_threshold=short_threshold,
            code_base=code_base,
            skip_short=True,
        )
    dsub = D // M
    _pq_cut_launch(
        (rows,),
        (q, centroids, lengths, histogram, workspace),
        (
            *q.stride()[:2],
            *centroids.stride()[:4],
            H,
            G,
            heavy,
            window,
            cand_lo,
            short_threshold,
            lut_off,
            words_off,
        ),
        dict(
            M=M,
            C=C,
            P=C**M,
            DSUB=dsub,
            BLOCK_D=min(dsub, 64),
            num_warps=CUT_WARPS,
            **pdl_meta(q.device, early=False),
        ),
    )
    w = weights if weights is not None else counts
    n_tok = max(n_tokens, 1)
    tensors = (codes, lengths, histogram, workspace, positions, counts, w)
    scalars = (
        *codes.stride(),
        *positions.stride()[:2],
        *w.stride()[:2],
        H,
        G,
        Hkv,
        weights.shape[2] if weights is not None else 0,
        sink,
        window,
        heavy,
        cand_lo,
        short_threshold,
        width,
        code_base,
        lut_off,
        words_off,
    )
    GP = 1 << (G - 1).bit_length()
    meta = dict(
        M=M, C=C, P=C**M, GP=GP, HAS_W=weights is not None, CONSUME_HIST=consume, **pdl_meta(q.device)
    )
    grid = (B * Hkv, -(-n_tok // config.kwargs["TILE"]))
    _pq_scan_launch(grid, tensors, scalars, {**meta, **config.all_kwargs()})
