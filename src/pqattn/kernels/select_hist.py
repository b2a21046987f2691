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

from pqattn.kernels.launch import Launcher
from pqattn.kernels.pdl import pdl_meta, release_next, wait_prior
from pqattn.kernels.select import (
    _SEPARATE_REDUCTIONS,
    _load_codes,
    _lut_base,
    _order_key,
    _probe,
    _sum_min_max,
    _write_lut,
)

MAX_COMBOS = 4096  # the cut kernel holds a row's P scores and counts in registers (= ops.MAX_COMBOS)
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
def _combo(code, M: tl.constexpr, BITS: tl.constexpr):
    """The combination index sum_m code[:, m] << (BITS * (M-1-m)) of codes [T, M] (int32)."""
    m = tl.arange(0, M)
    weight = tl.full([M], 1, tl.int32) << ((M - 1 - m) * BITS)
    return tl.sum(code * weight[None, :], axis=1)


@triton.jit
def _need(n, heavy, window, cand_lo):
    """Candidates [cand_lo, n - window) and how many of them the heavy part takes."""
    hi = n - window
    return hi, tl.minimum(heavy, tl.maximum(hi - cand_lo, 0))


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
    hi, need = _need(n, heavy, window, cand_lo)
    active = (hi > tl.maximum(cand_lo, tile * TILE)) & (cand_lo < tile * TILE + TILE)
    if SKIP_SHORT:
        active = active & (n > short_threshold) & (need > 0)
    if active:
        offs = tile * TILE + tl.arange(0, TILE)
        cand = (offs >= cand_lo) & (offs < hi)
        codes_row = codes_ptr + b * stride_kb + kvh * stride_kk - code_base * stride_kn
        combo = _combo(_load_codes(codes_row, offs, cand, stride_kn, stride_km, M), M, BITS)
        # one relaxed atomic per token: tl.histogram over P bins is slower (see select.py)
        tl.atomic_add(hist_ptr + grp.to(tl.int64) * P + combo, 1, mask=cand, sem="relaxed")


@triton.jit
def _upper_probit(c, total):
    """z with P(Z > z) = c / total for a standard normal Z (Abramowitz & Stegun 26.2.23, error
    below 5e-4; the tail clamped at 2^-40 and 1 - 2^-23): where a normal distribution of the
    scores would put the value that c of `total` tokens reach."""
    p = tl.minimum(tl.maximum(c / total, 9.094947e-13), 0.99999988)
    t = tl.sqrt(-1.3862944 * tl.log2(tl.minimum(p, 1.0 - p)))  # -2 ln
    z = t - (2.515517 + t * (0.802853 + t * 0.010328)) / (
        1.0 + t * (1.432788 + t * (0.189269 + t * 0.001308))
    )
    return tl.where(p < 0.5, z, -z)


# The first two probes aim at k / _SPREAD and k * _SPREAD tokens under the normal model, when k
# is at least 1 / _NORMAL_FROM of the candidates: further out in the tail the model places them
# worse than the interpolation between the extreme keys does (below).
_SPREAD: tl.constexpr = tl.constexpr(1.5)
_NORMAL_FROM: tl.constexpr = tl.constexpr(128)
# Rows of fewer combinations compile without the normal probes: few keys leave few steps to save,
# and at P = 16 under 4 warps the bucket kernel with them wrote out of bounds once (cause not
# found; docs/kernels/select.md).
_NORMAL_MIN_COMBOS: tl.constexpr = tl.constexpr(1024)


@triton.jit
def _sum_sum_combine(a0, b0, a1, b1):
    return a0 + a1, b0 + b1


@triton.jit
def _key_score(key):
    """The float32 score of an _order_key key (the inverse map)."""
    bits = tl.where((key >> 31) != 0, key & 0x7FFFFFFF, key ^ 0xFFFFFFFF)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _normal_probes(key, w, k, total):
    """(p_hi, p_lo) int64: the keys of the scores that the (k / _SPREAD)-th and the (k * _SPREAD)-th
    largest of `total` tokens would have if the tokens' scores (keys [P], w tokens each, 0 < k <
    total) were normally distributed with their weighted mean and variance."""
    valid = w > 0
    # The scores decoded from the keys (cheaper in registers than keeping them); a key of 0
    # decodes to NaN. The moments take a reduction of their own (carried by the search's first
    # one, every selection was slower).
    score = tl.where(valid, _key_score(key), 0.0)
    moment = w.to(tl.float32) * score
    if _SEPARATE_REDUCTIONS:
        s1, s2 = tl.sum(moment), tl.sum(moment * score)
    else:
        s1, s2 = tl.reduce((moment, moment * score), 0, _sum_sum_combine)
    n = total.to(tl.float32)
    mean = s1 / n
    kf = k.to(tl.float32)
    sd = tl.sqrt(tl.maximum(s2 / n - mean * mean, 0.0))
    p_hi = _order_key(mean + _upper_probit(kf / _SPREAD, n) * sd).to(tl.int64)
    p_lo = _order_key(mean + _upper_probit(tl.minimum(kf * _SPREAD, n - 0.5), n) * sd).to(tl.int64)
    return p_hi, p_lo


@triton.jit
def _weighted_cut(key, w, need):
    """(cut, quota, k) for keys [P] (0: no candidate; `_order_key` of the float32 scores) carrying
    w tokens each: the k = min(need, sum w) largest tokens are all those of keys > cut plus
    `quota` of those of key == cut.

    The search of pqattn.kernels.select._top_k with token counts: a bracket lo < hi of existing
    keys with c_lo = tokens at or above lo > k and c_hi = tokens at or above hi < k; each step
    probes a value inside (`_probe`) and snaps the bracket to the nearest keys on either side.
    When a row has at least _NORMAL_MIN_COMBOS combinations and k is at least 1/128 of its
    tokens, the first step probes two values in one reduction: where a normal distribution of the
    scores (the tokens' weighted mean and variance) puts the (k / 1.5)-th and the (1.5 k)-th
    largest, and the bracket usually holds few keys after it. Why these numbers, and the searches
    measured slower (four probes a step, a compacted finish): docs/kernels/select.md.
    """
    valid = w > 0
    total, lo, top = _sum_min_max(w, tl.where(valid, key, tl.full([], 0xFFFFFFFF, tl.uint32)), key)
    k = tl.minimum(need, total)
    lo = lo.to(tl.int64)
    hi = top.to(tl.int64) + 1
    c_lo = total
    c_hi = 0
    go = (k > 0) & (c_lo > k)
    if key.shape[0] >= _NORMAL_MIN_COMBOS:  # noqa: SIM102 (compile time; the inner test runs)
        if go & (k * _NORMAL_FROM >= total):  # (not followed by a bisection: the probes go on from there)
            p_hi, p_lo = _normal_probes(key, w, k, total)
            p_hi = tl.minimum(tl.maximum(p_hi, lo + 1), hi - 1)
            p_lo = tl.minimum(tl.maximum(tl.minimum(p_lo, p_hi), lo + 1), hi - 1)
            lo, hi, c_lo, c_hi = _bracket_step2(
                key, w, k, p_hi.to(tl.uint32), p_lo.to(tl.uint32), lo, hi, c_lo, c_hi
            )
            go = (c_lo > k) & (hi - lo > 1)
    bisect = False
    while go:
        p32 = _probe(lo, hi, c_lo, c_hi, k, bisect)
        width = hi - lo
        lo, hi, c_lo, c_hi = _bracket_step(key, w, k, p32, lo, hi, c_lo, c_hi)
        bisect = 2 * (hi - lo) > width
        go = (c_lo > k) & (hi - lo > 1)
    # c_lo == k: every key >= lo is taken (cut just below lo, no ties); else hi == lo + 1: lo is
    # the cut, c_hi tokens lie above it and the rest of the k are ties at lo.
    exact = c_lo == k
    cut = tl.where(k == 0, 0xFFFFFFFF, tl.where(exact, lo - 1, lo)).to(tl.uint32)
    quota = tl.where(exact, 0, tl.where(k == 0, 0, k - c_hi))
    return cut, quota, k


@triton.jit
def _two_counts_combine(a0, b0, c0, d0, e0, f0, a1, b1, c1, d1, e1, f1):
    return a0 + a1, tl.minimum(b0, b1), tl.maximum(c0, c1), d0 + d1, tl.minimum(e0, e1), tl.maximum(f0, f1)


@triton.jit
def _bracket_step2(key, w, k, p_hi, p_lo, lo, hi, c_lo, c_hi):
    """_bracket_step with two probes lo < p_lo <= p_hi < hi counted in one reduction: the bracket
    shrinks to the side of either, or between them."""
    d_hi = key - p_hi  # wraps: see _top_k
    d_lo = key - p_lo
    w_hi = tl.where(key >= p_hi, w, 0)
    w_lo = tl.where(key >= p_lo, w, 0)
    if _SEPARATE_REDUCTIONS:
        c1, min1, max1 = _sum_min_max(w_hi, d_hi, d_hi)
        c2, min2, max2 = _sum_min_max(w_lo, d_lo, d_lo)
    else:
        c1, min1, max1, c2, min2, max2 = tl.reduce(
            (w_hi, d_hi, d_hi, w_lo, d_lo, d_lo), 0, _two_counts_combine
        )
    up_hi = c1 >= k
    up_lo = c2 >= k
    lo = tl.where(up_hi, (p_hi + min1).to(tl.int64), tl.where(up_lo, (p_lo + min2).to(tl.int64), lo))
    c_lo = tl.where(up_hi, c1, tl.where(up_lo, c2, c_lo))
    hi = tl.where(up_hi, hi, tl.where(up_lo, (p_hi + max1).to(tl.int64) + 1, (p_lo + max2).to(tl.int64) + 1))
    c_hi = tl.where(up_hi, c_hi, tl.where(up_lo, c1, c2))
    return lo, hi, c_lo, c_hi


@triton.jit
def _bracket_step(key, w, k, p32, lo, hi, c_lo, c_hi):
    """Count the tokens at or above the probe p32 (lo < p32 < hi) and snap the bracket's end on
    that side to the nearest key."""
    diff = key - p32  # wraps: see _top_k
    c, d_min, d_max = _sum_min_max(tl.where(key >= p32, w, 0), diff, diff)
    up = c >= k
    lo = tl.where(up, (p32 + d_min).to(tl.int64), lo)
    c_lo = tl.where(up, c, c_lo)
    hi = tl.where(up, hi, (p32 + d_max).to(tl.int64) + 1)
    c_hi = tl.where(up, c_hi, c)
    return lo, hi, c_lo, c_hi


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
    [C**M], indexed as _combo indexes them, in the scan's order of addition ((0 + LUT[0, c_0]) +
    LUT[1, c_1]) + ... The sums are outer sums of the LUT's rows (M * C loads instead of a gather
    per combination and m), read back from memory: the values the scan reads, to the bit (values
    kept in registers need not be: the compiler may recompute a reduction in another layout, in
    another order)."""
    _write_lut(q_row, cent, lut_row, stride_cm, stride_cc, M, C, DSUB, BLOCK_D)
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
        _, need = _need(n, heavy, window, cand_lo)
        combo = tl.arange(0, P)
        w = tl.load(hist_ptr + (row // G).to(tl.int64) * P + combo)  # in flight with the LUT's loads
        score = _lut_and_scores(
            q_ptr + b * stride_qb + h * stride_qh,
            cent_ptr + b * stride_cb + kvh * stride_ck,
            _lut_base(ws_ptr) + lut_off + row * (M * C),
            stride_cm,
            stride_cc,
            M,
            C,
            DSUB,
            BLOCK_D,
        )
        key = tl.where(w > 0, _order_key(score), 0)
        cut, quota, k = _weighted_cut(key, w, need)
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
    hi, need = _need(n, heavy, window, cand_lo)
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
    code = _load_codes(codes_row, offs, cand, stride_kn, stride_km, M)
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
            lut = _lut_base(ws_ptr) + lut_off + (b * H + h) * (M * C)
            ok = g_ok[:, None] & cand[None, :]
            m_idx = tl.arange(0, M)
            score = tl.zeros([GP, TILE], tl.float32)
            for m in tl.static_range(M):
                code_m = tl.sum(tl.where(m_idx[None, :] == m, code, 0), axis=1)
                score += tl.load(lut[:, None] + m * C + code_m[None, :], mask=ok, other=0.0)
            key = _order_key(score)
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
    *,
    sink: int,
    window: int,
    heavy: int,
    cand_lo: int,
    short_threshold: int,
    width: int,
    positions: torch.Tensor,
    counts: torch.Tensor,
    workspace: torch.Tensor,
    n_tokens: int,
    histogram: torch.Tensor | None = None,
    weights: torch.Tensor | None = None,
    code_base: int = 0,
    config: triton.Config | None = None,
) -> None:
    """Launch the histogram selection on validated inputs (arguments as pqattn.kernels.select.pq_select).

    histogram: [B, Hkv, C**M] int32 counts of the candidate tokens [cand_lo, n - window) per
    combination for the current lengths (PQIndex keeps one); None counts them into the workspace
    first (one more launch). workspace: int32, zero-filled once, workspace_numel(B * H, M, C)
    elements. `config`: one of SCAN_CONFIGS for the scan (by default `scan_config(G)`).
    """
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
