"""Fine-code selection: every token's PQ score in many programs per row, then an exact top-k by
a histogram of the scores (SPEC §2; §7 fine codes, group selection, the re-rank's shortlist).

A row is what one selection serves: a query head (share="head") or a KV head and its G query
heads (share="group"). Three launches, none of which waits on one program's chain over the row:
1. `_lut_kernel`, one program per (row, chunk of sub-quantizers): the LUTs LUT[m, c, t] =
   <q_t,m, centroid[m, c]> of a row's T query vectors (one per head; the sum of the group's
   queries for the sum rule, whose PQ score is linear in q; one per head of the group for the
   max rule), a code's entries of every table side by side (rounded to bfloat16 for a group,
   SPEC §7: half the bytes a lookup reads), and each chunk's share of the bounds of any score,
   lo = sum_m min_c LUT and hi = sum_m max_c LUT (maxed over the tables for the max rule).
2. `_score_kernel`, grid (programs, rows), a row's candidates split evenly over its programs
   by its length (not by the token axis, the capacity, which may be far longer): each program
   first scores a strided sample of the row's candidates and takes from it the bins
   (`_pq_bins`; the program of the first candidate stores them for the collect): NBINS equal
   bins of [t0, hi], with t0 a sample score that the sample's expected count above the need-th
   score plus a margin reaches. Then
   each candidate's score (float32) into the workspace and a count per bin (a relaxed atomic a
   token at or above t0; the bulk of the scores, below t0, takes none). The bins are monotone
   in the score, so the need-th best score lies in one known bin; if fewer than need scores
   reach t0 (a sample far from the row), that bin is the one below t0, all of whose tokens are
   candidates for the rest. LUT entries are gathered from memory (L1; one vector load a code for
   the max rule's tables), or, for the max rule's G tables of at most 32 entries, from registers
   (`tl.gather` along the token axis: a warp shuffle a code). Memory-gather programs number
   about SCORE_PROGRAMS_PER_SM an SM in all, so that an SM serves one row, whose tables stay in
   its L1; register-LUT programs take a step each.
3. `_collect_kernel`, grid (chunks, rows), about COLLECT_PROGRAMS_PER_SM programs an SM over the
   rows, each a share of its row's blocks: each program finds that bin from the counts, writes
   its tokens of higher bins to the heavy part and those of that bin to a boundary list (both
   slots from one 64-bit atomic a block on the pair of counters), and writes its share of sink,
   window and padding. The last program of a row to arrive takes the rest from the boundary list:
   an all-pairs rank of at most TIE_TILE tokens, else a bisection over the order keys (exact for
   any count, slower); it then zeroes the row's counts and counters for the next call.
Linear bins from t0 put few tokens in the boundary bin for the bell-shaped sums that PQ scores
are; the fallbacks keep any distribution exact (a boundary bin below t0 is a long one: the
bisection). A re-rank (rerank=R) runs the collect into a shortlist of the top R * heavy, then
`_exact_kernel` (the shortlist's exact scores and their range), `_list_bins_kernel` (their bins
over that range) and the collect over the shortlist.
Design notes: docs/kernels/select.md.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from pqattn.kernels import paged
from pqattn.kernels.pdl import pdl_meta, wait_prior
from pqattn.kernels.select import AppendedKey
from pqattn.kernels.select.common import order_key, sm_count
from pqattn.reference import SelectParams
from pqattn.runtime.launch import Launcher

NBINS = 4096
TIE_TILE = 256  # boundary lists up to this size are ranked all-pairs
RANK_CHUNK = 32  # list entries each step of the all-pairs rank compares against
KTH_CHUNK = 2048  # bin counts each step of the search for the boundary bin reads
BOUNDARY_CAP = 4096  # boundary positions kept per row; past it the last program scans the row
# The PQ bins start at t0, a sample score that k = S f + SAMPLE_SIGMAS sqrt(S f) + SAMPLE_SLACK of
# the S sample scores reach (f: need over candidates). The sample's count above the need-th score
# is binomial (S, f), so fewer than need candidates reach t0 with a probability below 1e-9 a row
# for S in [128, 512] and f in [0.005, 0.16]. k of S / 2 or more bins every candidate.
SAMPLE_SIGMAS: tl.constexpr = tl.constexpr(6.0)
SAMPLE_SLACK: tl.constexpr = tl.constexpr(6.0)
# Bisection steps for t0 in the sample's range: t0 lands within 1/256 of that range below the k-th
# sample score, which only moves how many candidates are binned, never the selection.
THRESHOLD_STEPS: tl.constexpr = tl.constexpr(8)
BLOCK_N = 1024  # tokens (or shortlist entries) per program of the bins and collect launches
COLLECT_PROGRAMS_PER_SM = 4  # collect programs an SM over the rows, each a share of its row's blocks


def collect_programs(blocks: int, rows: int, sms: int) -> int:
    """Collect programs a row for `rows` rows of `blocks` blocks of BLOCK_N on the token axis (the
    capacity) on `sms` SMs: COLLECT_PROGRAMS_PER_SM a SM in all, at least one a row, at most one a
    block. A row splits its own blocks (up to its length) evenly over them, so the count follows
    the SMs and the rows, not the capacity: one block more of room must not add a program a row
    that re-reads the row's bins."""
    return min(max(COLLECT_PROGRAMS_PER_SM * sms // rows, 1), max(blocks, 1))


# The score launch: memory-gather programs of SCORE_WARPS warps loop over SCORE_ELEMENTS codes
# (tokens x M, for at most 4 tables; more spills registers) a step, each row split evenly into
# about SCORE_PROGRAMS_PER_SM x SMs / rows programs (two an SM keep more gathers in flight; a
# ragged last program per row measured slower); register-LUT programs take REG_LUT_ELEMENTS.
SCORE_ELEMENTS = 4096
SCORE_WARPS = 8
SCORE_PROGRAMS_PER_SM = 2
REG_LUT_ELEMENTS = 2048
INTERPRETER_SMS = 16  # the SM count assumed off the GPU (small test rows still split and loop)
# The max rule's G tables of at most this many centroids are gathered from registers (faster
# there; one table gathers as fast from memory: docs/kernels/select-log.md)
REG_LUT_MAX_C = 32
REG_LUT_SUB = 128  # tokens per step of the register-LUT scores (a [M, SUB // C, C] tile)
EXACT_BLOCK = 32  # shortlist entries per program of the exact scores (rows of D elements each)
LUT_PROGRAM_ELEMENTS = 2048  # centroid elements a program of the LUT launch multiplies (at most)
_CTR = 4  # per-row counters: heavy slots taken, boundary size, programs arrived, (spare)


class RowLayout(NamedTuple):
    """int32 offsets inside a row's workspace. The counters and bins must be zero before a call
    and are zero after it; the rest is written before it is read."""

    lut: int  # the tables [M, C, tables_p2] (a code's entries of every table side by side): float32,
    # or bfloat16 for a group (SPEC §7; the region keeps float32's size)
    bounds: int  # partial bounds of the PQ scores, float32 [tables, M-chunks <= M, 2]
    pq_bins: int  # the PQ scores' bins: their start t0 and bins per unit score, float32
    list_bounds: int  # min and max of the re-rank's exact scores
    counters: int
    bins: int
    scores: int  # float32 [N], by token
    boundary: int  # indices of the boundary bin's candidates [BOUNDARY_CAP]
    shortlist: int  # the re-rank's shortlist positions [rerank * heavy]
    list_scores: int  # their exact scores, float32
    size: int


def _aligned(at: int) -> int:
    """at rounded up to 16 int32 (64 bytes): Triton then knows the offset's alignment."""
    return -(-at // 16) * 16


@functools.cache
def row_layout(tables: int, M: int, C: int, N: int, shortlist: int = 0) -> RowLayout:
    """The workspace layout of a row with `tables` LUTs of M x C over N tokens and a re-rank
    shortlist of `shortlist` entries. Rows start 64-byte aligned, so that a code's entries of
    every table load as one vector."""
    lut = 0
    bounds = lut + triton.next_power_of_2(tables) * M * C
    pq_bins = bounds + 2 * tables * M
    list_bounds = pq_bins + 2
    ctr = _aligned(list_bounds + 2)  # 64-byte aligned: the collect adds to its first two as one int64
    bins = _aligned(ctr + _CTR)
    scores = bins + NBINS
    boundary = _aligned(scores + N)
    short = boundary + BOUNDARY_CAP
    list_scores = _aligned(short + shortlist)
    size = _aligned(list_scores + shortlist)
    return RowLayout(lut, bounds, pq_bins, list_bounds, ctr, bins, scores, boundary, short, list_scores, size)


def workspace_numel(rows: int, tables: int, M: int, C: int, N: int, shortlist: int = 0) -> int:
    return rows * row_layout(tables, M, C, N, shortlist).size


def sample_size(M: int, tables: int) -> int:
    """Tokens a step of the score launch's memory gathers takes (SCORE_ELEMENTS codes, of tables
    side by side for the max rule), and candidates its bins' sample scores."""
    return max(SCORE_ELEMENTS * 4 // (M * max(triton.next_power_of_2(tables), 4)), 16)


def sample_tokens(cand_lo: int, n_cand: int, sample: int) -> torch.Tensor:
    """The candidates whose scores place the bins' start (`_pq_bins`), int64 [sample]."""
    return cand_lo + torch.arange(sample, dtype=torch.int64) * max(n_cand, 1) // sample


def lut_chunks(M: int, C: int, dsub: int) -> int:
    """Programs per row of the LUT launch: chunks of sub-quantizers (a power of two of them)
    of at most LUT_PROGRAM_ELEMENTS centroid elements each, or one sub-quantizer."""
    per_chunk = 1
    while per_chunk * 2 <= M and per_chunk * 2 * C * dsub <= LUT_PROGRAM_ELEMENTS:
        per_chunk *= 2
    return M // per_chunk


@triton.jit
def _round_bf16(x):
    """x (float32) rounded to the nearest bfloat16, ties to even, by its bits (Triton's
    interpreter truncates a float32 -> bfloat16 cast; the rounded value then casts exactly)."""
    bits = x.to(tl.uint32, bitcast=True)
    up = bits + 0x7FFF + ((bits >> 16) & 1)
    rounded = (up & 0xFFFF0000).to(tl.float32, bitcast=True)
    return tl.where(x == x, rounded, x).to(tl.bfloat16)


@triton.jit
def _lut_kernel(
    q_ptr,
    cent_ptr,
    ws_ptr,
    k_ptr,
    phi_ptr,
    codes_ptr,
    len_ptr,
    arrive_ptr,
    kc_ptr,
    vc_ptr,
    vn_ptr,
    stride_qb,
    stride_qh,
    stride_cb,
    stride_ch,
    stride_cm,
    stride_cc,
    stride_kb,
    stride_kk,
    stride_kn,
    stride_ob,
    stride_ok,
    stride_on,
    stride_om,
    stride_kcb,
    stride_kck,
    stride_kcn,
    stride_kcd,
    stride_vcb,
    stride_vck,
    stride_vcn,
    stride_vcd,
    stride_vnb,
    stride_vnk,
    stride_vnd,
    ROWS_PER_B,
    G,
    ROW_WS,
    BOUNDS_AT,
    LIST_BOUNDS_AT,
    GROUP: tl.constexpr,  # a row is a KV head (else a query head)
    SUM_RULE: tl.constexpr,  # one table of the group's summed query (else one per head)
    M: tl.constexpr,
    C: tl.constexpr,
    DSUB: tl.constexpr,
    CHUNKS: tl.constexpr,  # programs per row, each over M // CHUNKS sub-quantizers
    TABLES_P2: tl.constexpr,  # the LUT's innermost extent: tables rounded up to a power of two
    LUT_BF16: tl.constexpr,  # entries rounded to bfloat16 (a group's tables, SPEC §7)
    ENCODE: tl.constexpr,  # also encode the step's new key (AppendedKey)
    IP: tl.constexpr,  # the new key is augmented for the ip metric (centroids of DSUB + 1)
    STORE_KV: tl.constexpr,  # and store its key and value rows into the caches
    KEY_AT_LENGTH: tl.constexpr,  # the new key is row lengths[b] of k (AppendedKey.at_length)
    PDL: tl.constexpr,
):
    """Program row * CHUNKS + chunk: LUT[m, c, t] = <q_t,m, centroid[m, c]> of every table t for
    the chunk's sub-quantizers, and the chunk's share of each table's score bounds (sum over its
    m of min_c and max_c LUT), which `_pq_bins` combines. One program makes all of a chunk's
    tables, so its centroids are read once and its entries (a code's tables side by side) are
    written as one block. Without ENCODE it is launched early behind the encode launch
    (pqattn.kernels.pdl): the query and centroids are read and the products made while that runs;
    the workspace is written after it. With ENCODE the launch does the encode's work itself
    (pqattn.kernels.encode, T = 1): the programs of a KV head's first row take the nearest
    centroid of the new key's sub-vectors from the same centroid loads, write the codes (and the
    rows into the caches) at lengths[b], and the last of a sequence's to arrive advances lengths[b]."""
    tables = G if (GROUP and not SUM_RULE) else 1  # pqattn.policy.lookup_tables
    pid = tl.program_id(0)
    chunk = pid % CHUNKS
    row = pid // CHUNKS
    b = row // ROWS_PER_B
    r = row % ROWS_PER_B
    kvh = r if GROUP else r // G
    first = kvh * G if GROUP else r
    queries = G if (GROUP and SUM_RULE) else 1
    MB: tl.constexpr = M // CHUNKS
    t = tl.arange(0, TABLES_P2)
    m = chunk * MB + tl.arange(0, MB)
    c_idx = tl.arange(0, C)
    t_ok = t < tables
    ws_row = ws_ptr + row.to(tl.int64) * ROW_WS
    lut_row = ws_row.to(tl.pointer_type(tl.float32), bitcast=True)
    cent = cent_ptr + b.to(tl.int64) * stride_cb + kvh * stride_ch
    q_b = q_ptr + b.to(tl.int64) * stride_qb
    if GROUP:  # one row of each KV head encodes its key (ENCODE)
        encoder = r >= 0
        kv_heads = ROWS_PER_B
    else:
        encoder = r % G == 0
        kv_heads = ROWS_PER_B // G
    key = k_ptr + b.to(tl.int64) * stride_kb + kvh * stride_kk
    if KEY_AT_LENGTH:
        key += tl.load(len_ptr + b).to(tl.int64) * stride_kn
    lut = tl.zeros([TABLES_P2, MB, C], tl.float32)
    dot = tl.zeros([MB, C], tl.float32)  # the new key's <x, c> and ||c||^2 (ENCODE)
    c_sq = tl.zeros([MB, C], tl.float32)
    x_sq = tl.zeros([MB], tl.float32)
    for d in tl.static_range(DSUB):  # a product per element of the sub-vectors: [T, MB, C] live
        cv = tl.load(cent + m[:, None] * stride_cm + c_idx[None, :] * stride_cc + d).to(tl.float32)
        qv = tl.zeros([TABLES_P2, MB], tl.float32)
        for g in range(queries):
            at_q = q_b + (first + t[:, None] + g) * stride_qh + m[None, :] * DSUB + d
            qv += tl.load(at_q, mask=t_ok[:, None], other=0.0).to(tl.float32)
        lut += qv[:, :, None] * cv[None, :, :]
        if ENCODE:
            xv = tl.load(key + m * DSUB + d, mask=m < tl.where(encoder, M, 0), other=0.0).to(tl.float32)
            dot += xv[:, None] * cv
            c_sq += cv * cv
            x_sq += xv * xv
    at = (m[None, :, None] * C + c_idx[None, None, :]) * TABLES_P2 + t[:, None, None]
    ok = tl.broadcast_to(t_ok[:, None, None], (TABLES_P2, MB, C))
    wait_prior(PDL)
    if ENCODE:  # noqa: SIM102 (compiled only with ENCODE; `encoder` is a runtime value)
        if encoder:
            # the encode launch's work for the chunk's sub-vectors of the new key: the nearest
            # centroids (ip-augmented as pqattn.kernels.codes.sub_distances does) at row lengths[b],
            # the chunk's elements of the K/V rows there, and the length advanced by the last of
            # the sequence's Hkv * CHUNKS programs to arrive
            if IP:
                c_extra = tl.load(cent + m[:, None] * stride_cm + c_idx[None, :] * stride_cc + DSUB)
                c_extra = c_extra.to(tl.float32)
                phi = tl.load(phi_ptr + (b * kv_heads + kvh) * M + m).to(tl.float32)
                dot += tl.sqrt(tl.maximum(phi - x_sq, 0.0))[:, None] * c_extra
                c_sq += c_extra * c_extra
            code = tl.argmin(c_sq - 2.0 * dot, axis=1, tie_break_left=True)
            row = tl.load(len_ptr + b).to(tl.int32)
            b64 = b.to(tl.int64)  # a KV cache can pass 2**31 elements
            out = codes_ptr + b64 * stride_ob + kvh * stride_ok + row.to(tl.int64) * stride_on
            tl.store(out + m * stride_om, code.to(codes_ptr.dtype.element_ty))
            if STORE_KV:
                el = chunk * (MB * DSUB) + tl.arange(0, MB * DSUB)  # the chunk's elements of a row
                k_dst = kc_ptr + b64 * stride_kcb + kvh * stride_kck + row.to(tl.int64) * stride_kcn
                v_dst = vc_ptr + b64 * stride_vcb + kvh * stride_vck + row.to(tl.int64) * stride_vcn
                v_src = vn_ptr + b64 * stride_vnb + kvh * stride_vnk
                tl.store(k_dst + el * stride_kcd, tl.load(key + el).to(kc_ptr.dtype.element_ty))
                v_row = tl.load(v_src + el * stride_vnd)
                tl.store(v_dst + el * stride_vcd, v_row.to(vc_ptr.dtype.element_ty))
            # every warp has read lengths[b] and stored its elements before the release below: a
            # warp that read it after the last arrival advanced it would write at the next row
            tl.debug_barrier()
            arrived = tl.atomic_add(arrive_ptr + b, 1, sem="acq_rel")
            if arrived == kv_heads * CHUNKS - 1:
                tl.store(len_ptr + b, (row + 1).to(len_ptr.dtype.element_ty))
                tl.store(arrive_ptr + b, 0)
    if LUT_BF16:
        rounded = _round_bf16(lut)
        tl.store(ws_row.to(tl.pointer_type(tl.bfloat16), bitcast=True) + at, rounded, mask=ok)
        lut = rounded.to(tl.float32)  # the bounds hold the rounded entries' scores
    else:
        tl.store(lut_row + at, lut, mask=ok)
    part = lut_row + BOUNDS_AT + (t * CHUNKS + chunk) * 2
    tl.store(part, tl.sum(tl.min(lut, axis=2), axis=1), mask=t_ok)
    tl.store(part + 1, tl.sum(tl.max(lut, axis=2), axis=1), mask=t_ok)
    if chunk == 0:
        # the re-rank's exact scores take their range by atomics: start it empty
        tl.store(lut_row + LIST_BOUNDS_AT, float("inf"))
        tl.store(lut_row + LIST_BOUNDS_AT + 1, float("-inf"))


@triton.jit
def _pq_bins(
    wsf,
    lutp,
    codes_row,
    stride_kn,
    stride_km,
    code_base,
    cand_lo,
    n_cand,
    need,
    BOUNDS_AT,
    TABLES: tl.constexpr,
    TABLES_P2: tl.constexpr,
    CHUNKS: tl.constexpr,
    M: tl.constexpr,
    C: tl.constexpr,
    MAX_RULE: tl.constexpr,
    SAMPLE: tl.constexpr,
    NBINS_: tl.constexpr,
):
    """(t0, inv) of the PQ scores' bins: NBINS bins over [t0, hi]. hi (lo) is each table's sum
    over sub-quantizers of max_c (min_c) LUT from the LUT launch's partials, maxed over the
    tables: any score of the sum or max rule lies in [lo, hi]. t0 is a score that k of SAMPLE
    candidates spread evenly over the row reach (k: see SAMPLE_SLACK), found by bisection in
    the sample's range; t0 = lo when k is half the sample or more, or without a sample (SAMPLE =
    0). A flat range puts every score from t0 in bin 0."""
    t = tl.arange(0, TABLES_P2)
    at = BOUNDS_AT + (t[:, None] * CHUNKS + tl.arange(0, CHUNKS)[None, :]) * 2
    real = t[:, None] < TABLES
    lo = tl.max(tl.where(t < TABLES, tl.sum(tl.load(wsf + at, mask=real, other=0.0), axis=1), float("-inf")))
    hi = tl.max(
        tl.where(t < TABLES, tl.sum(tl.load(wsf + at + 1, mask=real, other=0.0), axis=1), float("-inf"))
    )
    t0 = lo
    if SAMPLE > 0:
        i = tl.arange(0, SAMPLE)
        tok = cand_lo + (i.to(tl.int64) * tl.maximum(n_cand, 1) // SAMPLE).to(tl.int32)
        codes = _pq_codes(codes_row, tok, i >= 0, stride_kn, stride_km, code_base, M)
        s = _pq_scores_of(lutp, codes, M, C, TABLES, TABLES_P2, MAX_RULE)
        expect = SAMPLE * need.to(tl.float32) / tl.maximum(n_cand, 1).to(tl.float32)
        k = expect + SAMPLE_SIGMAS * tl.sqrt(expect) + SAMPLE_SLACK
        t0 = tl.min(s, axis=0)  # invariant: at least k sample scores reach t0
        top = tl.max(s, axis=0)
        for _ in range(THRESHOLD_STEPS):
            mid = t0 + (top - t0) * 0.5
            reach = tl.sum((s >= mid).to(tl.float32), axis=0) >= k
            t0 = tl.where(reach, mid, t0)
            top = tl.where(reach, top, mid)
        t0 = tl.where((need > 0) & (k < SAMPLE * 0.5), tl.minimum(tl.maximum(t0, lo), hi), lo)
    inv = tl.where(hi > t0, NBINS_ / tl.where(hi > t0, hi - t0, 1.0), 0.0)
    return t0, inv


@triton.jit
def _pq_codes(codes_row, tok, cand, stride_kn, stride_km, code_base, M: tl.constexpr):
    """The codes [BLOCK, M] of tokens [BLOCK] (0 where not cand), as stored (uint8)."""
    at = (tok - code_base).to(tl.int64)
    m = tl.arange(0, M)
    return tl.load(codes_row + at[:, None] * stride_kn + m[None, :] * stride_km, mask=cand[:, None], other=0)


@triton.jit
def _pq_scores_of(
    lutp,
    codes,
    M: tl.constexpr,
    C: tl.constexpr,
    TABLES: tl.constexpr,
    TABLES_P2: tl.constexpr,
    MAX_RULE: tl.constexpr,
):
    """The PQ scores [BLOCK] of codes [BLOCK, M] from the row's LUT in memory at lutp (float32
    or bfloat16 entries; float32 sums). A thread holds a token: each sub-quantizer's lookups are
    one vector load of the code's entries of every table, a warp's lanes in one sub-quantizer's
    table, and the sums and the max stay in the thread."""
    m = tl.arange(0, M)
    code = codes.to(tl.int32)
    tt = tl.arange(0, TABLES_P2)[None, :]
    real = tt < TABLES
    acc = tl.zeros([codes.shape[0], TABLES_P2], tl.float32)
    for j in tl.static_range(M):
        code_j = tl.sum(tl.where(m[None, :] == j, code, 0), axis=1)
        entry = (j * C + code_j) * TABLES_P2
        if TABLES == TABLES_P2:
            acc += tl.load(lutp + entry[:, None] + tt).to(tl.float32)
        else:
            acc += tl.load(lutp + entry[:, None] + tt, mask=real, other=float("-inf")).to(tl.float32)
    if MAX_RULE:
        return tl.max(acc, axis=1)
    else:
        return tl.sum(acc, axis=1)


@triton.jit
def _score_bin(s, lo, inv, NBINS_: tl.constexpr):
    """The bin of scores s: monotone in s; -1 below lo; NaN in bin 0."""
    x = tl.minimum(tl.maximum((s - lo) * inv, 0.0), NBINS_ - 1.0)
    return tl.where(s < lo, -1, tl.where(s == s, x.to(tl.int32), 0))


@triton.jit
def _list_bins(wsf, LIST_BOUNDS_AT, NBINS_: tl.constexpr):
    """(lo, inv) of the shortlist's exact scores' bins, from their min and max (a flat range
    puts every score in bin 0)."""
    lo = tl.load(wsf + LIST_BOUNDS_AT)
    hi = tl.load(wsf + LIST_BOUNDS_AT + 1)
    inv = tl.where(hi > lo, NBINS_ / tl.where(hi > lo, hi - lo, 1.0), 0.0)
    return lo, inv


@triton.jit
def _row_sizes(n, sink, window, heavy, cand_lo, short_threshold):
    """(short row, sink tokens, candidates' end, need, window's start) of a row of n tokens."""
    short = n <= short_threshold
    sink_n = tl.minimum(sink, n)
    cand_hi = n - window
    need = tl.where(short, 0, tl.minimum(heavy, tl.maximum(cand_hi - cand_lo, 0)))
    win_lo = tl.maximum(n - window, sink_n)
    return short, sink_n, cand_hi, need, win_lo


@triton.jit
def _bin_scores(ws_row, wsf, tok, cand, s, lo, inv, SCORES_AT, BINS_AT, NBINS_: tl.constexpr):
    tl.store(wsf + SCORES_AT + tok, s, mask=cand)
    bin_ = _score_bin(s, lo, inv, NBINS_)
    tl.atomic_add(ws_row + BINS_AT + bin_, 1, mask=cand & (bin_ >= 0), sem="relaxed")


@triton.jit
def _score_kernel(
    codes_ptr,
    len_ptr,
    ws_ptr,
    stride_kb,
    stride_kh,
    stride_kn,
    stride_km,
    ROWS_PER_B,
    G,
    n_codes,
    code_base,
    sink,
    window,
    heavy,
    cand_lo,
    short_threshold,
    ROW_WS,
    BOUNDS_AT,
    PQ_BINS_AT,
    BINS_AT,
    SCORES_AT,
    GROUP: tl.constexpr,
    MAX_RULE: tl.constexpr,
    TABLES: tl.constexpr,
    TABLES_P2: tl.constexpr,
    CHUNKS: tl.constexpr,  # the LUT launch's programs per table (its partial sums)
    M: tl.constexpr,
    C: tl.constexpr,
    NBINS_: tl.constexpr,
    BLOCK: tl.constexpr,  # tokens per step (a program's span is a multiple of it)
    REG_LUT: tl.constexpr,  # the tables gathered from registers (C <= REG_LUT_MAX_C, tables > 1)
    SUB: tl.constexpr,  # tokens per step of the register-LUT loop
    SAMPLE: tl.constexpr,  # candidates scored for the bins' start (0: the bins span [lo, hi])
    LUT_BF16: tl.constexpr,  # the LUT's entries are bfloat16 (else float32)
):
    chunk = tl.program_id(0)
    row = tl.program_id(1)
    b = row // ROWS_PER_B
    r = row % ROWS_PER_B
    kvh = r if GROUP else r // G
    n = tl.load(len_ptr + b).to(tl.int32)
    _, _, cand_hi, need, _ = _row_sizes(n, sink, window, heavy, cand_lo, short_threshold)
    cand_end = tl.where(need > 0, cand_hi, cand_lo)
    # the row's candidates (not the token axis, which may be far longer: the capacity) split
    # evenly over the row's programs, in steps of BLOCK
    span = tl.cdiv(cand_end - cand_lo, tl.num_programs(0) * BLOCK) * BLOCK
    first = cand_lo + chunk * span
    if first < cand_end:
        ws_row = ws_ptr + row.to(tl.int64) * ROW_WS
        wsf = ws_row.to(tl.pointer_type(tl.float32), bitcast=True)
        lutp = ws_row.to(tl.pointer_type(tl.bfloat16 if LUT_BF16 else tl.float32), bitcast=True)
        codes_row = codes_ptr + b.to(tl.int64) * stride_kb + kvh * stride_kh
        own_end = tl.minimum(cand_end, first + span)  # the end of this program's candidates
        if not REG_LUT:
            # a step's codes load while the step before is scored (the first's with the sample)
            tok_next = first + tl.arange(0, BLOCK)
            codes_next = _pq_codes(
                codes_row, tok_next, (tok_next >= cand_lo) & (tok_next < own_end), stride_kn, stride_km,
                code_base, M,
            )  # fmt: skip
        lo, inv = _pq_bins(
            wsf, lutp, codes_row, stride_kn, stride_km, code_base, cand_lo, cand_hi - cand_lo, need,
            BOUNDS_AT, TABLES, TABLES_P2, CHUNKS, M, C, MAX_RULE, SAMPLE, NBINS_,
        )  # fmt: skip
        if chunk == 0:  # the first candidate's program
            tl.store(wsf + PQ_BINS_AT, lo)
            tl.store(wsf + PQ_BINS_AT + 1, inv)
        if REG_LUT:
            # The max rule's tables of at most a warp's width live in registers, a sub-quantizer's
            # C entries across C lanes: tl.gather along the token axis is one warp shuffle a code.
            m3 = tl.arange(0, M)[:, None, None]
            j3 = tl.arange(0, C)[None, None, :]
            t3 = tl.arange(0, SUB // C)[None, :, None]
            table = tl.load(lutp + (m3 * C + j3) * TABLES_P2).to(tl.float32)
            table = tl.broadcast_to(table, [M, SUB // C, C])
            tok2 = tl.arange(0, SUB // C)[:, None] * C + tl.arange(0, C)[None, :]
            for step in range(0, span, SUB):
                base = first + step
                tok3 = base + t3 * C + j3
                cand3 = (tok3 >= cand_lo) & (tok3 < cand_end)
                at3 = (tok3 - code_base).to(tl.int64)
                code = tl.load(codes_row + at3 * stride_kn + m3 * stride_km, mask=cand3, other=0).to(tl.int32)
                s = tl.sum(tl.gather(table, code, axis=2), axis=0)
                for t in range(1, TABLES):  # (the register route serves the max rule only)
                    other = tl.load(lutp + (m3 * C + j3) * TABLES_P2 + t).to(tl.float32)
                    other = tl.broadcast_to(other, [M, SUB // C, C])
                    s = tl.maximum(s, tl.sum(tl.gather(other, code, axis=2), axis=0))
                tok = base + tok2
                cand = (tok >= cand_lo) & (tok < cand_end)
                _bin_scores(ws_row, wsf, tok, cand, s, lo, inv, SCORES_AT, BINS_AT, NBINS_)
        else:
            for step in range(0, span, BLOCK):
                tok = first + step + tl.arange(0, BLOCK)
                cand = (tok >= cand_lo) & (tok < cand_end)
                codes = codes_next
                tok_next = tok + BLOCK
                codes_next = _pq_codes(
                    codes_row, tok_next, (tok_next >= cand_lo) & (tok_next < own_end), stride_kn, stride_km,
                    code_base, M,
                )  # fmt: skip
                s = _pq_scores_of(lutp, codes, M, C, TABLES, TABLES_P2, MAX_RULE)
                _bin_scores(ws_row, wsf, tok, cand, s, lo, inv, SCORES_AT, BINS_AT, NBINS_)


@triton.jit
def _kth_bin(bins_row, need, NBINS_: tl.constexpr, CHUNK: tl.constexpr):
    """(the bin holding the need-th best score, tokens in higher bins) from the row's counts
    (need >= 1). Tokens at or above a bin never grow with its index, so the bins that reach need
    are a prefix; the counts are read CHUNK at a time from the top. Fewer than need tokens binned:
    (-1, all of them), the bin below the bins' start."""
    kth = tl.full([], -1, tl.int32)
    above = tl.zeros([], tl.int32)
    run = tl.zeros([], tl.int32)  # tokens in the bins above the chunk
    for i in range(NBINS_ // CHUNK):
        base = (NBINS_ // CHUNK - 1 - i) * CHUNK
        idx = base + tl.arange(0, CHUNK)
        h = tl.load(bins_row + idx, cache_modifier=".cg")
        at_or_above = run + tl.sum(h, axis=0) - tl.cumsum(h, axis=0) + h
        hits = tl.sum((at_or_above >= need).to(tl.int32), axis=0)
        first = (kth < 0) & (hits > 0)
        last_hit = base + hits - 1
        above = tl.where(first, tl.sum(tl.where(idx == last_hit, at_or_above - h, 0), axis=0), above)
        kth = tl.where(first, last_hit, kth)
        run += tl.sum(h, axis=0)
    return kth, tl.where(kth < 0, run, above)


@triton.jit
def _collect_kernel(
    len_ptr,
    pos_ptr,
    cnt_ptr,
    ws_ptr,
    stride_pb,
    stride_ph,
    stride_cb,
    stride_ch,
    ROWS_PER_B,
    sink,
    window,
    heavy,
    cand_lo,
    short_threshold,
    list_heavy,
    ROW_WS,
    PQ_BINS_AT,
    LIST_BOUNDS_AT,
    CTR_AT,
    BINS_AT,
    SCORES_AT,
    BOUNDARY_AT,
    LIST_AT,
    LIST_SCORES_AT,
    WIDTH: tl.constexpr,
    ENTRIES: tl.constexpr,  # entries of the positions list each program writes (a power of two)
    NBINS_: tl.constexpr,
    CAP: tl.constexpr,
    TIE: tl.constexpr,
    RANK_CHUNK_: tl.constexpr,
    KTH_CHUNK: tl.constexpr,
    BLOCK: tl.constexpr,
    FROM_LIST: tl.constexpr,  # candidates: the shortlist's entries (else the tokens)
    TO_LIST: tl.constexpr,  # the heavy part goes to the shortlist (else the output, with the rest)
):
    chunk = tl.program_id(0)
    row = tl.program_id(1)
    chunks = tl.num_programs(0)
    b = row // ROWS_PER_B
    r = row % ROWS_PER_B
    n = tl.load(len_ptr + b).to(tl.int32)
    short, sink_n, cand_hi, need, win_lo = _row_sizes(n, sink, window, heavy, cand_lo, short_threshold)
    ws_row = ws_ptr + row.to(tl.int64) * ROW_WS
    wsf = ws_row.to(tl.pointer_type(tl.float32), bitcast=True)
    ctr = ws_row + CTR_AT
    pos_row = pos_ptr + b * stride_pb + r * stride_ph
    heavy_at = ws_row + LIST_AT if TO_LIST else pos_row + sink_n

    if not TO_LIST:
        # this program's share of the list: sink, window, padding (and every token of a short row)
        e = chunk * ENTRIES + tl.arange(0, ENTRIES)
        count = tl.where(short, n, sink_n + need + (n - win_lo))
        fixed = tl.where(e < sink_n, e, win_lo + e - sink_n - need)
        fixed = tl.where(e < count, tl.where(short, e, fixed), -1)
        fixed_part = (e < tl.where(short, WIDTH, sink_n)) | (e >= sink_n + need)
        tl.store(pos_row + e, fixed, mask=(e < WIDTH) & fixed_part)
        if chunk == 0:
            tl.store(cnt_ptr + b * stride_cb + r * stride_ch, count)

    if need > 0:
        # candidates: indices [src_lo, src_hi) of the tokens or of the shortlist
        if FROM_LIST:
            src_lo = 0
            src_hi = _row_sizes(n, sink, window, list_heavy, cand_lo, short_threshold)[3]
        else:
            src_lo = cand_lo
            src_hi = cand_hi
        kth, above = _kth_bin(ws_row + BINS_AT, need, NBINS_, KTH_CHUNK)
        if FROM_LIST:
            lo, inv = _list_bins(wsf, LIST_BOUNDS_AT, NBINS_)
        else:
            lo = tl.load(wsf + PQ_BINS_AT)
            inv = tl.load(wsf + PQ_BINS_AT + 1)
        scores_at = LIST_SCORES_AT if FROM_LIST else SCORES_AT
        # (several blocks a program: each program reads the row's bins once for the boundary bin).
        # A block's heavy and boundary counts go in one 64-bit atomic on the counter pair (heavy
        # slots in its low half, boundary slots in its high half) and one scan of 16-bit halves;
        # the next block's scores load while this block's atomic is in flight.
        tl.static_assert(BLOCK < 65536)
        ctr_pair = ctr.to(tl.pointer_type(tl.int64), bitcast=True)
        # the blocks up to the row's last candidate (not the token axis, which may be far longer),
        # split evenly over the row's programs, each taking its blocks one after the other
        steps = tl.cdiv(tl.cdiv(src_hi, BLOCK), chunks)
        first = chunk * steps * BLOCK + tl.arange(0, BLOCK)
        own_hi = tl.minimum(src_hi, (chunk + 1) * steps * BLOCK)  # the end of this program's blocks
        s_next = tl.load(wsf + scores_at + first, mask=(first >= src_lo) & (first < own_hi), other=0.0)
        for step in range(steps):
            i = (chunk * steps + step) * BLOCK + tl.arange(0, BLOCK)
            cand = (i >= src_lo) & (i < src_hi)
            s = s_next
            j = i + BLOCK
            s_next = tl.load(wsf + scores_at + j, mask=(j >= src_lo) & (j < own_hi), other=0.0)
            bin_ = _score_bin(s, lo, inv, NBINS_)
            take = cand & (bin_ > kth)
            edge = cand & (bin_ == kth)
            flags = take.to(tl.int32) + (edge.to(tl.int32) << 16)
            total = tl.sum(flags, axis=0)
            if total > 0:
                add = (total & 0xFFFF).to(tl.int64) + ((total >> 16).to(tl.int64) << 32)
                base = tl.atomic_add(ctr_pair, add, sem="relaxed")
                upto = tl.cumsum(flags, axis=0)
                slot = (base & 0xFFFFFFFF).to(tl.int32) + (upto & 0xFFFF) - 1
                tl.store(heavy_at + slot, _position(ws_row, i, take, LIST_AT, FROM_LIST), mask=take)
                slot = (base >> 32).to(tl.int32) + (upto >> 16) - 1
                tl.store(ws_row + BOUNDARY_AT + slot, i, mask=edge & (slot < CAP))

        tl.debug_barrier()  # every thread's stores precede the release below
        if tl.atomic_add(ctr + 2, 1, sem="acq_rel") == chunks - 1:
            rest = need - above
            size = tl.atomic_add(ctr + 1, 0, sem="acquire")
            _finish_boundary(
                ws_row,
                wsf,
                heavy_at + above,
                rest,
                size,
                kth,
                lo,
                inv,
                src_lo,
                src_hi,
                scores_at,
                BOUNDARY_AT,
                LIST_AT,
                NBINS_,
                CAP,
                TIE,
                BLOCK,
                FROM_LIST,
                RANK_CHUNK_,
            )
            _zero_row(ws_row + BINS_AT, ctr, NBINS_)


@triton.jit
def _position(ws_row, i, ok, LIST_AT, FROM_LIST: tl.constexpr):
    """The token positions of candidate indices i: themselves, or the shortlist's entries."""
    if FROM_LIST:
        return tl.load(ws_row + LIST_AT + i, mask=ok, other=0)
    else:
        return i


@triton.jit
def _finish_boundary(
    ws_row,
    wsf,
    out_at,
    rest,
    size,
    kth,
    lo,
    inv,
    src_lo,
    src_hi,
    scores_at,
    BOUNDARY_AT,
    LIST_AT,
    NBINS_: tl.constexpr,
    CAP: tl.constexpr,
    TIE: tl.constexpr,
    BLOCK: tl.constexpr,
    FROM_LIST: tl.constexpr,
    CHUNK: tl.constexpr,  # entries each step of the all-pairs rank compares against
):
    """Write the positions of the `rest` best of the boundary bin's `size` candidates at out_at
    (ties any)."""
    if size <= TIE:
        i = tl.arange(0, TIE)
        idx = tl.load(ws_row + BOUNDARY_AT + i, mask=i < size, other=0)
        key = tl.where(i < size, order_key(tl.load(wsf + scores_at + idx, mask=i < size, other=0.0)), 0)
        # rank = how many precede the entry: higher keys, and equal keys earlier in the list;
        # counted against CHUNK entries at a time (a [TIE, TIE] tile spills registers)
        rank = tl.zeros([TIE], tl.int32)
        for j0 in tl.static_range(0, TIE, CHUNK):
            if j0 < size:
                j = j0 + tl.arange(0, CHUNK)
                idx_j = tl.load(ws_row + BOUNDARY_AT + j, mask=j < size, other=0)
                key_j = tl.where(
                    j < size, order_key(tl.load(wsf + scores_at + idx_j, mask=j < size, other=0.0)), 0
                )
                before = (key_j[None, :] > key[:, None]) | (
                    (key_j[None, :] == key[:, None]) & (j[None, :] < i[:, None])
                )
                rank += tl.sum(before.to(tl.int32), axis=1)
        keep = (i < size) & (rank < rest)
        tl.store(out_at + rank, _position(ws_row, idx, keep, LIST_AT, FROM_LIST), mask=keep)
    else:
        # A bisection over the order keys for the rest-th best of the bin: from the kept list when
        # it holds them all, else from every candidate (exact, slower).
        from_kept = size <= CAP
        span = tl.where(from_kept, size, src_hi)
        lo_key = tl.zeros([], tl.uint32)  # invariant: >= rest keys at or above lo_key
        hi_key = tl.full([], 0xFFFFFFFF, tl.uint32)  # and fewer than rest above hi_key
        above = tl.zeros([], tl.int32)  # keys above hi_key
        edge = (ws_row, wsf, span, from_kept, kth, lo, inv, src_lo, scores_at, BOUNDARY_AT)
        while lo_key < hi_key:
            mid = lo_key + (hi_key - lo_key) // 2 + 1
            c = tl.zeros([], tl.int32)
            for start in range(0, span, BLOCK):
                key, _i, ok = _edge_keys(start, *edge, NBINS_, BLOCK)
                c += tl.sum((ok & (key >= mid)).to(tl.int32), axis=0)
            if c >= rest:
                lo_key = mid
            else:
                hi_key = mid - 1
                above = c
        # the keys above lo_key first, then ties at lo_key up to rest, in one pass
        taken = tl.zeros([], tl.int32)
        tied = above
        for start in range(0, span, BLOCK):
            key, idx, ok = _edge_keys(start, *edge, NBINS_, BLOCK)
            sel = ok & (key > lo_key)
            tie = ok & (key == lo_key)
            slot = tied + tl.cumsum(tie.to(tl.int32), axis=0) - 1
            tie = tie & (slot < rest)
            p = _position(ws_row, idx, sel | tie, LIST_AT, FROM_LIST)
            tl.store(out_at + taken + tl.cumsum(sel.to(tl.int32), axis=0) - 1, p, mask=sel)
            tl.store(out_at + slot, p, mask=tie)
            taken += tl.sum(sel.to(tl.int32), axis=0)
            tied += tl.sum(tie.to(tl.int32), axis=0)


@triton.jit
def _edge_keys(
    start,
    ws_row,
    wsf,
    span,
    from_kept,
    kth,
    lo,
    inv,
    src_lo,
    scores_at,
    BOUNDARY_AT,
    NBINS_: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Order keys, candidate indices and validity of a tile of the boundary bin's candidates:
    entries of the kept list, or the candidates in [start, start + BLOCK) that fall in bin kth."""
    j = start + tl.arange(0, BLOCK)
    inside = j < span
    # (scalar bools stay out of the masks: Triton's interpreter turns them into int32 masks)
    listed = j < tl.where(from_kept, span, 0)
    idx = tl.where(listed, tl.load(ws_row + BOUNDARY_AT + j, mask=listed, other=0), j)
    s = tl.load(wsf + scores_at + idx, mask=inside, other=0.0)
    ok = listed | (inside & (idx >= src_lo) & (_score_bin(s, lo, inv, NBINS_) == kth))
    return order_key(s), idx, ok


@triton.jit
def _zero_row(bins_row, ctr, NBINS_: tl.constexpr):
    tl.store(bins_row + tl.arange(0, NBINS_), tl.zeros([NBINS_], tl.int32))
    tl.store(ctr + tl.arange(0, 4), tl.zeros([4], tl.int32))


@triton.jit
def _exact_kernel(
    q_ptr,
    k_ptr,
    len_ptr,
    ws_ptr,
    bt_ptr,
    stride_qb,
    stride_qh,
    stride_kb,
    stride_kh,
    stride_kn,
    stride_tb,
    ROWS_PER_B,
    G,
    sink,
    window,
    cand_lo,
    short_threshold,
    list_heavy,
    ROW_WS,
    LIST_BOUNDS_AT,
    LIST_AT,
    LIST_SCORES_AT,
    GROUP: tl.constexpr,
    MAX_RULE: tl.constexpr,
    D: tl.constexpr,
    PAGE: tl.constexpr,  # tokens per block of a paged key cache (SPEC §8); 0: contiguous
    BLOCK: tl.constexpr,
):
    """The shortlist's exact scores <q, k> (float32; the group's sum or max over its heads) and
    their range (atomic min and max)."""
    chunk = tl.program_id(0)
    row = tl.program_id(1)
    b = row // ROWS_PER_B
    r = row % ROWS_PER_B
    kvh = r if GROUP else r // G
    first = kvh * G if GROUP else r
    heads = G if GROUP else 1
    n = tl.load(len_ptr + b).to(tl.int32)
    count = _row_sizes(n, sink, window, list_heavy, cand_lo, short_threshold)[3]
    e = chunk * BLOCK + tl.arange(0, BLOCK)
    ok = e < count
    if tl.max(ok.to(tl.int32), axis=0) != 0:
        ws_row = ws_ptr + row.to(tl.int64) * ROW_WS
        wsf = ws_row.to(tl.pointer_type(tl.float32), bitcast=True)
        p = tl.load(ws_row + LIST_AT + e, mask=ok, other=0).to(tl.int64)
        d = tl.arange(0, D)
        k_row = paged.cache_base(k_ptr, b, kvh, stride_kb, stride_kh, PAGE)
        at = paged.token_offsets(p, ok, bt_ptr + b * stride_tb, stride_kb, stride_kn, PAGE)
        k = tl.load(k_row + at[:, None] + d[None, :], mask=ok[:, None], other=0.0).to(tl.float32)
        q_b = q_ptr + b.to(tl.int64) * stride_qb
        s = tl.sum(k * tl.load(q_b + first * stride_qh + d).to(tl.float32)[None, :], axis=1)
        for g in range(1, heads):
            s_g = tl.sum(k * tl.load(q_b + (first + g) * stride_qh + d).to(tl.float32)[None, :], axis=1)
            s = tl.maximum(s, s_g) if MAX_RULE else s + s_g
        tl.store(wsf + LIST_SCORES_AT + e, s, mask=ok)
        tl.atomic_min(wsf + LIST_BOUNDS_AT, tl.min(tl.where(ok, s, float("inf")), axis=0), sem="relaxed")
        tl.atomic_max(wsf + LIST_BOUNDS_AT + 1, tl.max(tl.where(ok, s, float("-inf")), axis=0), sem="relaxed")


@triton.jit
def _list_bins_kernel(
    len_ptr,
    ws_ptr,
    sink,
    window,
    cand_lo,
    short_threshold,
    list_heavy,
    ROW_WS,
    LIST_BOUNDS_AT,
    BINS_AT,
    LIST_SCORES_AT,
    ROWS_PER_B,
    NBINS_: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """The bins of the shortlist's exact scores over their range."""
    chunk = tl.program_id(0)
    row = tl.program_id(1)
    b = row // ROWS_PER_B
    n = tl.load(len_ptr + b).to(tl.int32)
    count = _row_sizes(n, sink, window, list_heavy, cand_lo, short_threshold)[3]
    e = chunk * BLOCK + tl.arange(0, BLOCK)
    ok = e < count
    if tl.max(ok.to(tl.int32), axis=0) != 0:
        ws_row = ws_ptr + row.to(tl.int64) * ROW_WS
        wsf = ws_row.to(tl.pointer_type(tl.float32), bitcast=True)
        lo, inv = _list_bins(wsf, LIST_BOUNDS_AT, NBINS_)
        s = tl.load(wsf + LIST_SCORES_AT + e, mask=ok, other=0.0)
        tl.atomic_add(ws_row + BINS_AT + _score_bin(s, lo, inv, NBINS_), 1, mask=ok, sem="relaxed")


_lut_launch = Launcher(_lut_kernel)
_score_launch = Launcher(_score_kernel)
_collect_launch = Launcher(_collect_kernel)
_exact_launch = Launcher(_exact_kernel)
_list_bins_launch = Launcher(_list_bins_kernel)


def pq_select_fine(
    q: torch.Tensor,
    centroids: torch.Tensor,
    codes: torch.Tensor,
    lengths: torch.Tensor,
    params: SelectParams,
    *,
    positions: torch.Tensor,
    counts: torch.Tensor,
    workspace: torch.Tensor,
    share: str = "head",
    group_rule: str = "sum",
    tables: int = 1,
    n_tokens: int | None = None,
    code_base: int = 0,
    rerank: int = 0,
    keys: torch.Tensor | None = None,
    block_table: torch.Tensor | None = None,
    appended: AppendedKey | None = None,
) -> None:
    """Launch on validated inputs. q [B, H, D]; centroids [B, Hkv, M, C, dsub(+1)] (M, C and dsub
    powers of two); codes [B, Hkv, n_codes, M] holding tokens code_base + row; positions [B, R, L]
    and counts [B, R] with R = H (share="head") or Hkv ("group"); tables: the LUTs a row scores
    with (pqattn.policy.lookup_tables: G for the group max rule, else 1); workspace: int32, zero-filled
    once, at least `workspace_numel(B * R, tables, M, C, N, rerank * heavy)` elements (left
    zeroed where it must be). params.cand_lo must be at least code_base. rerank=R >= 1 with keys
    [B, Hkv, >= N, D] (D a power of two): the top R * heavy by PQ score into the shortlist, their
    exact scores, then the top heavy of those (three more launches). appended: the step's new
    key, encoded by the LUT launch (pqattn.kernels.select.AppendedKey; needs window >= 1 and
    code_base 0)."""
    B, H, D = q.shape
    Hkv, M, C = centroids.shape[1], centroids.shape[2], centroids.shape[3]
    G = H // Hkv
    N = codes.shape[2] + code_base if n_tokens is None else n_tokens
    group = share == "group"
    sum_rule = group_rule == "sum"
    rows_per_b = Hkv if group else H
    rows = B * rows_per_b
    expected_tables = G if group and not sum_rule else 1  # the LUT launch's grid assumes it
    if tables != expected_tables:
        raise ValueError(
            f"tables: expected {expected_tables} for share={share!r}, group_rule={group_rule!r}, "
            f"G={G}, got {tables}"
        )
    list_heavy = rerank * params.heavy
    tables_p2 = triton.next_power_of_2(tables)
    lay = row_layout(tables, M, C, N, list_heavy)
    sink, window, heavy, cand_lo, short_threshold, width = params
    chunks = max(-(-N // BLOCK_N), 1)
    lut_progs = lut_chunks(M, C, D // M)
    if appended is not None:
        _check_appended(appended, q, centroids, codes, lengths, params, code_base)
        k_new, phi, arrivals = appended.keys, appended.phi, appended.arrivals
        k_cache, v_cache, v_new = appended.kv_cache or (k_new, k_new, k_new)
        phi_or = centroids if phi is None else phi  # (not read for euclidean keys)
        enc_tensors = (k_new, phi_or, codes, lengths, arrivals, k_cache, v_cache, v_new)
        enc_strides = (
            k_new.stride(0),
            k_new.stride(1),
            k_new.stride(2),
            *codes.stride(),
            *k_cache.stride(),
            *v_cache.stride(),
            v_new.stride(0),
            v_new.stride(1),
            v_new.stride(3),
        )
    else:  # (not read)
        enc_tensors, enc_strides = (q,) * 8, (0,) * 18
    _lut_launch(
        (rows * lut_progs,),
        (q, centroids, workspace, *enc_tensors),
        (
            *q.stride()[:2],
            *centroids.stride()[:4],
            *enc_strides,
            rows_per_b,
            G,
            lay.size,
            lay.bounds,
            lay.list_bounds,
        ),
        dict(
            GROUP=group,
            SUM_RULE=sum_rule,
            M=M,
            C=C,
            DSUB=D // M,
            CHUNKS=lut_progs,
            TABLES_P2=tables_p2,
            LUT_BF16=group,
            ENCODE=appended is not None,
            IP=appended is not None and appended.phi is not None,
            STORE_KV=appended is not None and appended.kv_cache is not None,
            KEY_AT_LENGTH=appended is not None and appended.at_length,
            num_warps=4,
            # behind the encode launch it starts early; encoding, it reads the step's new key
            **pdl_meta(q.device, early=appended is None),
        ),
    )
    reg_lut = C <= REG_LUT_MAX_C and tables > 1
    sub = max(REG_LUT_SUB, C)
    # the max rule's vector loads hold tables_p2 entries a code: fewer codes a step. Register-LUT
    # programs cover a step each: a sample there would double their work, so they bin every score.
    gather_block = sample_size(M, tables)
    if reg_lut:
        score_block = max(REG_LUT_ELEMENTS // M, sub)
        per_row = max(-(-N // score_block), 1)
        score_warps = 4
    else:
        score_block = gather_block
        # each row in the same number of programs, about SCORE_PROGRAMS_PER_SM an SM in all
        sms = sm_count(q.device) if q.device.type == "cuda" else INTERPRETER_SMS
        per_row = min(max(SCORE_PROGRAMS_PER_SM * sms // rows, 1), max(-(-N // score_block), 1))
        score_warps = SCORE_WARPS
    _score_launch(
        (per_row, rows),
        (codes, lengths, workspace),
        (
            *codes.stride(),
            rows_per_b,
            G,
            codes.shape[2],
            code_base,
            sink,
            window,
            list_heavy or heavy,
            cand_lo,
            short_threshold,
            lay.size,
            lay.bounds,
            lay.pq_bins,
            lay.bins,
            lay.scores,
        ),
        dict(
            GROUP=group,
            MAX_RULE=group and not sum_rule,
            TABLES=tables,
            TABLES_P2=tables_p2,
            CHUNKS=lut_progs,
            M=M,
            C=C,
            NBINS_=NBINS,
            BLOCK=score_block,
            REG_LUT=reg_lut,
            SUB=sub,
            SAMPLE=0 if reg_lut else gather_block,
            LUT_BF16=group,
            num_warps=score_warps,
        ),
    )

    def collect(blocks: int, stage_heavy: int, from_list: bool, to_list: bool) -> None:
        sms = sm_count(q.device) if q.device.type == "cuda" else INTERPRETER_SMS
        grid_chunks = collect_programs(blocks, rows, sms)
        _collect_launch(
            (grid_chunks, rows),
            (lengths, positions, counts, workspace),
            (
                *positions.stride()[:2],
                *counts.stride(),
                rows_per_b,
                sink,
                window,
                stage_heavy,
                cand_lo,
                short_threshold,
                list_heavy,
                lay.size,
                lay.pq_bins,
                lay.list_bounds,
                lay.counters,
                lay.bins,
                lay.scores,
                lay.boundary,
                lay.shortlist,
                lay.list_scores,
            ),
            dict(
                WIDTH=width,
                ENTRIES=triton.next_power_of_2(max(-(-width // grid_chunks), 1)),
                NBINS_=NBINS,
                CAP=BOUNDARY_CAP,
                TIE=TIE_TILE,
                RANK_CHUNK_=min(RANK_CHUNK, TIE_TILE),
                KTH_CHUNK=KTH_CHUNK,
                BLOCK=BLOCK_N,
                FROM_LIST=from_list,
                TO_LIST=to_list,
                num_warps=4,
            ),
        )

    if not rerank:
        collect(chunks, heavy, False, False)
        return
    list_chunks = max(-(-list_heavy // BLOCK_N), 1)
    collect(chunks, list_heavy, False, True)
    bt = block_table if block_table is not None else lengths  # (not read unpaged)
    _exact_launch(
        (max(-(-list_heavy // EXACT_BLOCK), 1), rows),
        (q, keys, lengths, workspace, bt),
        (
            *q.stride()[:2],
            *paged.cache_strides(keys, block_table),
            bt.stride(0),
            rows_per_b,
            G,
            sink,
            window,
            cand_lo,
            short_threshold,
            list_heavy,
            lay.size,
            lay.list_bounds,
            lay.shortlist,
            lay.list_scores,
        ),
        dict(
            GROUP=group,
            MAX_RULE=group and not sum_rule,
            D=D,
            PAGE=keys.shape[1] if block_table is not None else 0,
            BLOCK=EXACT_BLOCK,
            num_warps=4,
        ),
    )
    _list_bins_launch(
        (list_chunks, rows),
        (lengths, workspace),
        (
            sink,
            window,
            cand_lo,
            short_threshold,
            list_heavy,
            lay.size,
            lay.list_bounds,
            lay.bins,
            lay.list_scores,
            rows_per_b,
        ),
        dict(NBINS_=NBINS, BLOCK=BLOCK_N, num_warps=4),
    )
    collect(list_chunks, heavy, True, False)


def _check_appended(
    appended: AppendedKey,
    q: torch.Tensor,
    centroids: torch.Tensor,
    codes: torch.Tensor,
    lengths: torch.Tensor,
    params: SelectParams,
    code_base: int,
) -> None:
    """What the LUT launch's encode assumes of an AppendedKey (the caller's layout, checked once
    per launch signature by the caller's plan)."""
    B, Hkv, D = q.shape[0], centroids.shape[1], q.shape[2]
    shape = (B, Hkv, 1, D)
    if params.window < 1 or code_base != 0:
        raise ValueError(
            f"appended: the new key is coded at row lengths[b] inside the window; expected window >= 1 "
            f"and code_base 0, got window={params.window}, code_base={code_base}"
        )
    rows = [] if appended.at_length else [("appended.keys", appended.keys)]
    if appended.at_length:
        cache = appended.keys
        if (
            tuple(cache.shape[:2]) != (B, Hkv)
            or cache.shape[3] != D
            or cache.shape[2] < codes.shape[2]
            or cache.stride(-1) != 1
        ):
            raise ValueError(
                f"appended.keys: expected a key cache [B, Hkv, >= {codes.shape[2]}, D] = "
                f"[{B}, {Hkv}, >= {codes.shape[2]}, {D}] with a contiguous last dim (at_length), "
                f"got {list(cache.shape)} with strides {cache.stride()}"
            )
    if appended.kv_cache is not None:
        rows.append(("appended.kv_cache values", appended.kv_cache[2]))
        for name, cache in zip(("k_cache", "v_cache"), appended.kv_cache[:2], strict=True):
            if tuple(cache.shape[:2]) != (B, Hkv) or cache.shape[3] != D or cache.shape[2] < codes.shape[2]:
                raise ValueError(
                    f"appended.kv_cache {name}: expected [B, Hkv, >= {codes.shape[2]}, D] = "
                    f"[{B}, {Hkv}, >= {codes.shape[2]}, {D}], got {list(cache.shape)}"
                )
    for name, t in rows:
        if tuple(t.shape) != shape or t.stride(-1) != 1:
            raise ValueError(
                f"{name}: expected [B, Hkv, 1, D] = {list(shape)} with a contiguous last dim, "
                f"got {list(t.shape)} with strides {t.stride()}"
            )
    arrivals = appended.arrivals
    if arrivals.dtype != torch.int32 or tuple(arrivals.shape) != (B,) or lengths.shape != (B,):
        raise ValueError(
            f"appended.arrivals: expected int32 [B] = [{B}] beside lengths [B], got {arrivals.dtype} "
            f"{list(arrivals.shape)} and lengths {list(lengths.shape)}"
        )
    if (appended.phi is None) != (centroids.shape[4] == D // centroids.shape[2]):
        raise ValueError(
            "appended.phi: expected phi [B, Hkv, M] exactly when the centroids are ip-augmented "
            f"(width dsub + 1), got phi={'None' if appended.phi is None else list(appended.phi.shape)} "
            f"with centroid width {centroids.shape[4]}"
        )
