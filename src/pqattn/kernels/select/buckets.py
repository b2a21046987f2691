"""PQ top-k selection from the index's buckets (SPEC §2): one launch, one program per query row,
and no code of a bucketed token read.

With at most MAX_COMBOS code combinations (pqattn.kernels.select.hist), PQIndex keeps the
candidate tokens grouped by combination, the inverted lists of an IVF index ("buckets"):
`order` [B, Hkv, capacity] holds the positions [cand_lo, frozen[b]) of sequence b sorted by
combination and `starts` [B, Hkv, P + 1] where each combination's run begins (P = C**M).
`frozen[b]` is where the candidates ended when the buckets were built (`bucket_tokens`); the
candidates appended since, [frozen[b], n - window), are "recent" and are scanned. A row's
selection is then:
  1. as in the histogram selection's cut launch: the LUT, the score of every combination
     (gathered from the LUT in memory), and a weighted search over the histogram of all candidates
     for the cut (every combination above it is taken whole, `quota` tokens of those at it);
  2. the bucketed tokens taken, copied from `order`: the runs of the combinations above the cut
     into the first slots, and of those at it the first ones up to the quota into the slots from
     k - quota, laid out by exclusive sums over the combinations. Each slot finds its run through
     marks: the first slot of each run gets (slot + 1, run start - slot) packed in 64 bits in the
     workspace, and a running maximum over the slots carries every run's mark to its other slots
     (then the marks are zeroed);
  3. the recent tokens, scored from the LUT exactly as the combinations were (the same memory
     values, added in the same order), compared with the cut: those above it fill the slots
     between the bucketed ones above and k - quota, those at it the slots after the bucketed
     ties up to the quota;
  4. sink, window, count and -1 padding; with dense weights [B, H, n_weights] (the original's
     weight_list), the ones at the selected positions, after the row's zeros. While the rows
     leave SMs idle, other programs of the launch write the zeros ("zero programs", a share of
     the row each), and whichever of a row's programs arrives last at its counter writes the
     ones; else the row's program writes the zeros first (under PDL while the encode launch
     ahead runs).
With NewKey the launch also does the encode launch's work for one new key per sequence and KV
head: its codes, the histogram's change and the lengths (see NewKey).
A selection reads the histogram, the starts, about `heavy` entries of `order` and the recent
codes: O(P + heavy + recent) per row instead of the O(N) scan of pqattn.kernels.select.hist,
whose one-program-per-token-tile launch it replaces. Ties break by bucket order. No host sync,
no allocation: the marks and the arrival counters are reset after use, so the workspace stays
as the owner zero-filled it and the launch can be replayed from a CUDA graph. The buckets must
describe the codes and lengths: PQIndex rebuilds them (in place) with `bucket_tokens`; recent
tokens cost a scan, so it does so when they grow (PQIndex.REINDEX_AFTER).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pqattn.kernels.codes import candidacy_changes, sub_distances
from pqattn.kernels.pdl import pdl_meta, wait_prior
from pqattn.kernels.select import NewKey
from pqattn.kernels.select.common import (
    SEPARATE_REDUCTIONS,
    code_combination,
    load_codes,
    lut_base,
    order_key,
    row_need,
    sm_count,
    weighted_cut,
    write_lut,
)
from pqattn.kernels.select.hist import HIST_TILE, count_combos
from pqattn.reference.selection import SelectParams
from pqattn.runtime.launch import Launcher

# Warps per row program (and slots or tokens per step of its loops), where the runs' bounds are
# loaded, and a register cap. Every config is exercised by the tests and by `pqattn check`. One
# stage: pipelined, the loops' loads of the marks and the LUT could become asynchronous copies,
# which read L2, where this program's own stores need not have arrived; plain loads see them after
# the barrier.
BUCKET_CONFIGS = [
    triton.Config({"CHUNK": 1024, "LATE_RUNS": False}, num_warps=4, num_stages=1),
    triton.Config({"CHUNK": 2048, "LATE_RUNS": False}, num_warps=8, num_stages=1),
    triton.Config({"CHUNK": 1024, "LATE_RUNS": True}, num_warps=4, num_stages=1, maxnreg=168),
]


def select_config(rows: int, device: torch.device) -> triton.Config:
    """By how many programs the SMs hold at once (a row's latency is the time while they hold all):
    8 warps while the rows fit one program per SM; 4 warps (255 registers a thread at P = 4096:
    two programs per SM) while they fit two; beyond that 4 warps capped at 168 registers (three
    per SM; some spill) with the runs' bounds loaded after the search. The figures, and the
    warps and caps measured slower: docs/kernels/select-log.md."""
    if device.type == "cuda":
        sms = sm_count(device)
        if rows <= sms:
            return BUCKET_CONFIGS[1]
        if rows > 2 * sms:
            return BUCKET_CONFIGS[2]
    return BUCKET_CONFIGS[0]


# each config's launch options, made once (Config.all_kwargs builds a dict per call)
_CONFIG_KWARGS = {id(c): c.all_kwargs() for c in BUCKET_CONFIGS}


_BIAS: tl.constexpr = tl.constexpr(1 << 31)


def zero_programs_for(rows: int, device: torch.device) -> int:
    """Programs per row that write a row of dense weights' zeros beside its selection: as many as
    the SMs the row programs leave idle hold (at most 8), none once the rows fill the SMs: a row
    of the original's weights is 128 KB at N = 32K, a burden on one SM's store bandwidth."""
    if device.type != "cuda":
        return 0
    return min(8, max(0, sm_count(device) // rows - 1))


def workspace_layout(rows: int, M: int, C: int, heavy: int) -> tuple[int, int, int, int]:
    """int32-word offsets of the LUTs, of the marks (int64, `heavy` per row) and of the arrival
    counters: per row (the dense weights' zero programs), then per (sequence, KV head) (NewKey's
    histogram change under GQA; rows of them, as there are at most as many), and the total."""
    luts = 0
    marks = luts + rows * M * C
    marks += marks % 2  # 8-byte aligned
    done = marks + 2 * rows * heavy
    return luts, marks, done, done + 2 * rows


def workspace_numel(rows: int, M: int, C: int, heavy: int) -> int:
    return workspace_layout(rows, M, C, heavy)[-1]


@triton.jit
def _max_combine(a, b):
    return tl.maximum(a, b)


@triton.jit
def _sum3_combine(a0, b0, c0, a1, b1, c1):
    return a0 + a1, b0 + b1, c0 + c1


@triton.jit
def _sum3(a, b, c):
    """The sums of three tiles, in one reduction when compiled (see select._SEPARATE_REDUCTIONS)."""
    if SEPARATE_REDUCTIONS:
        return tl.sum(a), tl.sum(b), tl.sum(c)
    else:
        return tl.reduce((a, b, c), 0, _sum3_combine)


@triton.jit
def _zero_row(w_row, lo, hi, CHUNK: tl.constexpr):
    """w_row[lo:hi] = 0."""
    lane = tl.arange(0, CHUNK)
    for start in range(lo, hi, CHUNK):
        o = start + lane
        tl.store(w_row + o, tl.zeros([CHUNK], w_row.dtype.element_ty), mask=o < hi)


@triton.jit
def _write_ones(pos_row, count, first, w_row, CHUNK: tl.constexpr):
    """w_row[positions[0:count]] = 1, `first` holding positions[0:CHUNK] (the rest read through
    L2: another program may have written them)."""
    lane = tl.arange(0, CHUNK)
    one = tl.full([CHUNK], 1.0, tl.float32).to(w_row.dtype.element_ty)
    tl.store(w_row + first, one, mask=lane < count)
    for start in range(CHUNK, count, CHUNK):
        o = start + lane
        p = tl.load(pos_row + o, mask=o < count, other=0, cache_modifier=".cg")
        tl.store(w_row + p, one, mask=o < count)


# What the row's selection adds to its counter when it arrives (a zero program adds 1).
_SELECTED: tl.constexpr = tl.constexpr(1 << 16)


@triton.jit
def _arrive_at_row(done, add, last):
    """Arrive at the row's counter (the selection adds _SELECTED, a zero program 1) once this
    program's writes to the row are done (released by the arrival); whether the counter held
    `last` before: then this program is the last of the row's (the selection and its zero
    programs, in any order), and writes the ones, which must follow every zero, and resets the
    counter."""
    tl.debug_barrier()  # every thread's stores precede the arrival
    return tl.atomic_add(done, add, sem="acq_rel") == last


@triton.jit
def _new_codes(
    x_row,
    stride_xd,
    cent,
    phi_row,
    code_out,
    stride_om,
    stride_cm,
    stride_cc,
    q_row,
    lut_row,
    M: tl.constexpr,
    C: tl.constexpr,
    DSUB: tl.constexpr,
    BLOCK_D: tl.constexpr,
    IP: tl.constexpr,
    WITH_LUT: tl.constexpr,
):
    """Store the codes of the key at x_row (its M sub-vectors' nearest centroids) at code_out
    (m at m * stride_om) and, WITH_LUT, the query's LUT row as write_lut does."""
    for m in tl.static_range(M):
        dist, q_dot = sub_distances(
            x_row + m * DSUB * stride_xd,
            stride_xd,
            True,
            cent + m * stride_cm,
            stride_cc,
            phi_row + m,
            q_row + m * DSUB,
            C,
            DSUB,
            BLOCK_D,
            IP,
            WITH_LUT,
        )
        if WITH_LUT:
            tl.store(lut_row + m * C + tl.arange(0, C), q_dot)
        code = tl.argmin(dist, axis=0, tie_break_left=True)
        tl.store(code_out + m * stride_om, code.to(code_out.dtype.element_ty))


@triton.jit
def _arrive(counter, ARRIVALS, CHUNK: tl.constexpr):
    """Count this program at `counter` (once every thread has read what the last one changes): a
    [CHUNK] mask, true at one lane if this program is the last of ARRIVALS. From one lane of a
    block: a scalar atomic's result is broadcast through a barrier right away, this one's is
    waited for only where that lane uses it."""
    lane = tl.arange(0, CHUNK)
    first = lane == 0
    arrived = tl.atomic_add(counter + lane * 0, first.to(tl.int32), mask=first, sem="acq_rel")
    return first & (arrived == ARRIVALS - 1)


@triton.jit
def _pq_bucket_kernel(
    codes_ptr,
    len_ptr,
    cursor_ptr,
    order_ptr,
    stride_kb,
    stride_kk,
    stride_kn,
    stride_km,
    stride_ob,
    stride_ok,
    Hkv,
    window,
    cand_lo,
    M: tl.constexpr,
    BITS: tl.constexpr,
    P: tl.constexpr,
    TILE: tl.constexpr,
):
    """order[b, kvh, cursor[combo]++] = position, for the candidate tokens of this tile."""
    grp = tl.program_id(0)
    tile = tl.program_id(1)
    b = grp // Hkv
    kvh = grp % Hkv
    hi = tl.load(len_ptr + b).to(tl.int32) - window
    if (hi > tl.maximum(cand_lo, tile * TILE)) & (cand_lo < tile * TILE + TILE):
        offs = tile * TILE + tl.arange(0, TILE)
        cand = (offs >= cand_lo) & (offs < hi)
        codes_row = codes_ptr + b * stride_kb + kvh * stride_kk
        combo = code_combination(load_codes(codes_row, offs, cand, stride_kn, stride_km, M), M, BITS)
        slot = tl.atomic_add(cursor_ptr + grp.to(tl.int64) * P + combo, 1, mask=cand, sem="relaxed")
        tl.store(order_ptr + b.to(tl.int64) * stride_ob + kvh * stride_ok + slot, offs, mask=cand)


@triton.jit
def _pq_bucket_select_kernel(
    q_ptr,
    cent_ptr,
    codes_ptr,
    len_ptr,
    hist_ptr,
    order_ptr,
    starts_ptr,
    frozen_ptr,
    ws_ptr,
    pos_ptr,
    cnt_ptr,
    w_ptr,
    x_ptr,
    phi_ptr,
    stride_qb,
    stride_qh,
    stride_cb,
    stride_ck,
    stride_cm,
    stride_cc,
    stride_kb,
    stride_kk,
    stride_kn,
    stride_km,
    stride_ob,
    stride_ok,
    stride_pb,
    stride_ph,
    stride_wb,
    stride_wh,
    stride_xb,
    stride_xk,
    stride_xd,
    n_weights,
    zero_span,
    rows,
    H,
    G,
    Hkv,
    sink,
    window,
    heavy,
    cand_lo,
    short_threshold,
    width,
    marks_off,
    done_off,
    row0,
    n_drop,
    M: tl.constexpr,
    C: tl.constexpr,
    BITS: tl.constexpr,
    P: tl.constexpr,
    DSUB: tl.constexpr,
    BLOCK_D: tl.constexpr,
    CHUNK: tl.constexpr,
    LATE_RUNS: tl.constexpr,
    HAS_W: tl.constexpr,
    ZERO_PROGS: tl.constexpr,
    ENCODE: tl.constexpr,
    IP: tl.constexpr,
    PDL: tl.constexpr,
):
    ONES: tl.constexpr = HAS_W and ZERO_PROGS > 0
    pid = tl.program_id(0)
    lane = tl.arange(0, CHUNK)
    zeroing = False  # (without zero programs the branch is not compiled)
    if ZERO_PROGS > 0:
        zeroing = pid >= rows
    if zeroing:  # zeros over a share of a row's dense weights
        _zero_program(
            pid, rows, H, G, Hkv, w_ptr, stride_wb, stride_wh, n_weights, zero_span, ws_ptr, done_off,
            pos_ptr, stride_pb, stride_ph, cnt_ptr, width, x_ptr, stride_xb, stride_xk, stride_xd,
            cent_ptr, stride_cb, stride_ck, stride_cm, stride_cc, phi_ptr, codes_ptr, stride_kb,
            stride_kk, stride_kn, stride_km, row0, q_ptr, M, C, DSUB, BLOCK_D, CHUNK, ZERO_PROGS, ENCODE, IP,
        )  # fmt: skip
    else:
        row = pid
        b = row // H
        h = row % H
        kvh = h // G
        grp = b * Hkv + kvh
        pos_row = pos_ptr + b * stride_pb + h * stride_ph
        w_row = w_ptr + b.to(tl.int64) * stride_wb + h * stride_wh
        lut_row = lut_base(ws_ptr) + row * (M * C)
        q_row = q_ptr + b * stride_qb + h * stride_qh
        cent_row = cent_ptr + b * stride_cb + kvh * stride_ck
        codes_row = codes_ptr + b * stride_kb + kvh * stride_kk
        if PDL:  # launched early behind the encode launch: first what that one does not write
            write_lut(q_row, cent_row, lut_row, stride_cm, stride_cc, M, C, DSUB, BLOCK_D)
            if HAS_W and ZERO_PROGS == 0:
                _zero_row(w_row, 0, n_weights, CHUNK)
            wait_prior(PDL)
            tl.debug_barrier()  # the LUT and the zeros are visible to every thread after it
        elif HAS_W and ZERO_PROGS == 0:  # the ones overwrite them after a barrier
            _zero_row(w_row, 0, n_weights, CHUNK)
        if ENCODE:
            # The new key of this row's KV head, as the encode launch writes it
            # (pqattn.kernels.encode, T = 1 over n_drop rows). Its own row is in the window
            # (window >= 1): no program of the launch reads its code, which the row's first zero
            # program writes, off this program's path (without zero programs, this one, with the
            # LUT); under GQA the head's G rows store the same codes. The candidacy change is
            # applied to this program's copy of the histogram; with H == Hkv this program writes it
            # back at the end, once every thread has read the histogram, else the last of the
            # head's G rows to have read it (_arrive). The row is row0 (NewKey.length - 1): the
            # programs of the launch read no length, so the first of each sequence's stores the
            # new one.
            x_row = x_ptr + b * stride_xb + kvh * stride_xk
            _, old_combo, old_change = candidacy_changes(
                codes_row, stride_kn, stride_km, True, 0, 1, row0, n_drop, window, cand_lo, M, C
            )
            hist_done = ws_ptr + done_off + rows + grp
            last = lane == 0
            n = row0 + 1
            if h == 0:
                tl.store(len_ptr + b, n.to(len_ptr.dtype.element_ty))
        else:
            n = tl.load(len_ptr + b).to(tl.int32)
        if ENCODE and ZERO_PROGS == 0:  # the key's codes with the LUT, from one centroid load
            _new_codes(
                x_row,
                stride_xd,
                cent_row,
                phi_ptr + grp * M,
                codes_row + row0 * stride_kn,
                stride_km,
                stride_cm,
                stride_cc,
                q_row,
                lut_row,
                M,
                C,
                DSUB,
                BLOCK_D,
                IP,
                True,
            )
        if n <= short_threshold:  # short sequence: every token
            for start in range(0, width, CHUNK):
                o = start + lane
                tl.store(pos_row + o, tl.where(o < n, o, -1), mask=o < width)
            count = n
            if HAS_W and ZERO_PROGS > 0:
                fast = n < 0  # (the ones after the positions)
            if ENCODE:  # noqa: SIM102 (compile time; the inner test runs)
                if G > 1:
                    last = _arrive(hist_done, G, CHUNK)
        else:
            hi, need = row_need(n, heavy, window, cand_lo)
            n_sink = tl.minimum(sink, n)
            win_lo = tl.maximum(hi, n_sink)
            n_win = n - win_lo

            # The first recent tokens' codes, the histogram and the runs' bounds are in flight
            # with the LUT's loads.
            rec_lo = tl.maximum(tl.load(frozen_ptr + b), cand_lo)
            rec_hi = tl.where(need > 0, hi, cand_lo)
            code_next = load_codes(codes_row, rec_lo + lane, rec_lo + lane < rec_hi, stride_kn, stride_km, M)

            # 1. The cut.
            combo = tl.arange(0, P)
            w = tl.load(hist_ptr + grp.to(tl.int64) * P + combo)
            if ENCODE:  # this call's change, written back to the histogram at the end
                w += tl.where(combo == old_combo, old_change, 0)
            starts_row = starts_ptr + grp.to(tl.int64) * (P + 1)
            if not LATE_RUNS:
                run = tl.load(starts_row + combo)
                run_len = tl.load(starts_row + combo + 1) - run
            if not PDL and not (ENCODE and ZERO_PROGS == 0):  # (loads in flight with the ones above)
                write_lut(q_row, cent_row, lut_row, stride_cm, stride_cc, M, C, DSUB, BLOCK_D)
            tl.debug_barrier()  # the other threads' LUT stores are visible after it
            if ENCODE:  # noqa: SIM102 (compile time; the inner test runs)
                if G > 1:  # every thread has read the histogram (w) before the barrier
                    last = _arrive(hist_done, G, CHUNK)
            if HAS_W and ZERO_PROGS > 0:
                # Whether the row's zero programs are done (from one lane, reduced after the cut):
                # then the ones go out with the positions below, else after them.
                seen = tl.atomic_add(
                    ws_ptr + done_off + row + lane * 0, lane * 0, mask=lane == 0, sem="acquire"
                )
            # Each combination's score gathered from the LUT in memory, added in the order the recent
            # tokens' scores are (bit for bit the same sums), in the layout of the other [P] vectors
            # (sums in registers reshaped to [P] gave wrong rows here: docs/kernels/select.md).
            score = tl.zeros([P], tl.float32)
            for m in tl.static_range(M):
                digit = (combo >> (BITS * (M - 1 - m))) & (C - 1)
                score += tl.load(lut_row + m * C + digit)
            key = tl.where(w > 0, order_key(score), 0)
            cut, quota, k = weighted_cut(key, w, need)
            # the ones of the dense weights written with the positions (ONES), where `with_ones`
            with_ones = lane < 0
            one = tl.full([CHUNK], 1.0, tl.float32).to(w_ptr.dtype.element_ty)
            if ONES:
                fast = tl.max(tl.where(lane == 0, seen, 0), 0) == ZERO_PROGS
                with_ones = lane < tl.where(fast, CHUNK, 0)  # (a block mask: see `at_cut`)
            if LATE_RUNS:  # loaded after the search, they hold no registers through it
                run = tl.load(starts_row + combo)
                run_len = tl.load(starts_row + combo + 1) - run

            # 2. Bucketed tokens; 3. recent tokens; 4. sink, window, count, -1 padding.
            n_above, n_tie, tie_lo = _bucketed_tokens(
                key, w, cut, quota, k, run, run_len, ws_ptr, marks_off, row, heavy, order_ptr,
                b, kvh, stride_ob, stride_ok, pos_row, n_sink, w_row, one, with_ones, P, CHUNK, ONES,
            )  # fmt: skip
            _recent_tokens(
                rec_lo, rec_hi, code_next, codes_row, stride_kn, stride_km, lut_row, cut, k, n_above,
                tie_lo + n_tie, quota - n_tie, pos_row, n_sink, w_row, one, with_ones, M, C, CHUNK, ONES,
            )  # fmt: skip
            count = _fixed_parts(pos_row, n_sink, k, n_win, win_lo, width, w_row, one, with_ones, CHUNK, ONES)
        tl.store(cnt_ptr + row, count)
        if ENCODE:
            tl.debug_barrier()  # every thread has read the histogram
            tl.atomic_add(
                hist_ptr + grp.to(tl.int64) * P + old_combo + lane * 0,
                old_change + lane * 0,
                mask=last & (lane * 0 + old_change != 0),  # (block & block: see `at_cut`)
                sem="relaxed",
            )
            if G > 1:
                tl.store(hist_done + lane * 0, lane * 0, mask=last)  # (left at zero)
        if HAS_W and ZERO_PROGS == 0:
            tl.debug_barrier()  # the positions every thread has written
            _write_ones(pos_row, count, tl.load(pos_row + lane, mask=lane < count, other=0), w_row, CHUNK)
        if HAS_W and ZERO_PROGS > 0:
            if fast:  # the ones are out; every zero program has arrived
                tl.store(ws_ptr + done_off + row, 0)
            else:
                tl.debug_barrier()  # the positions every thread has written
                # (the first chunk of them in flight with the arrival; loaded before it, as it
                # reads this program's own stores)
                first = tl.load(pos_row + lane, mask=lane < count, other=0)
                if _arrive_at_row(ws_ptr + done_off + row, _SELECTED, ZERO_PROGS):
                    _write_ones(pos_row, count, first, w_row, CHUNK)
                    tl.store(ws_ptr + done_off + row, 0)


@triton.jit
def _zero_program(
    pid,
    rows,
    H,
    G,
    Hkv,
    w_ptr,
    stride_wb,
    stride_wh,
    n_weights,
    zero_span,
    ws_ptr,
    done_off,
    pos_ptr,
    stride_pb,
    stride_ph,
    cnt_ptr,
    width,
    x_ptr,
    stride_xb,
    stride_xk,
    stride_xd,
    cent_ptr,
    stride_cb,
    stride_ck,
    stride_cm,
    stride_cc,
    phi_ptr,
    codes_ptr,
    stride_kb,
    stride_kk,
    stride_kn,
    stride_km,
    row0,
    q_ptr,
    M: tl.constexpr,
    C: tl.constexpr,
    DSUB: tl.constexpr,
    BLOCK_D: tl.constexpr,
    CHUNK: tl.constexpr,
    ZERO_PROGS: tl.constexpr,
    ENCODE: tl.constexpr,
    IP: tl.constexpr,
):
    """A zero program: zeros over its share of a row's dense weights; the last of the row's to
    arrive writes the ones of its positions; the row's first encodes the new key (ENCODE)."""
    lane = tl.arange(0, CHUNK)
    row = (pid - rows) // ZERO_PROGS
    b = row // H
    h = row % H
    w_row = w_ptr + b.to(tl.int64) * stride_wb + h * stride_wh
    part = (pid - rows) % ZERO_PROGS
    z_lo = part * zero_span
    z_hi = tl.minimum(z_lo + zero_span, n_weights)
    _zero_row(w_row, z_lo, z_hi, CHUNK)
    # (the zeros out first: the selection looks for them to write its ones with its positions)
    if _arrive_at_row(ws_ptr + done_off + row, 1, _SELECTED + ZERO_PROGS - 1):
        pos_row = pos_ptr + b * stride_pb + h * stride_ph
        count = tl.load(cnt_ptr + row, cache_modifier=".cg").to(tl.int32)
        first = tl.load(pos_row + lane, mask=lane < width, other=0, cache_modifier=".cg")
        _write_ones(pos_row, count, first, w_row, CHUNK)
        tl.store(ws_ptr + done_off + row, 0)
    if ENCODE:  # noqa: SIM102 (compile time; the inner test runs)
        if part == 0:  # the new key of the row's KV head (the selection's ENCODE in the kernel)
            kvh = h // G
            _new_codes(
                x_ptr + b * stride_xb + kvh * stride_xk,
                stride_xd,
                cent_ptr + b * stride_cb + kvh * stride_ck,
                phi_ptr + (b * Hkv + kvh) * M,
                codes_ptr + b * stride_kb + kvh * stride_kk + row0 * stride_kn,
                stride_km,
                stride_cm,
                stride_cc,
                q_ptr,
                q_ptr,
                M,
                C,
                DSUB,
                BLOCK_D,
                IP,
                False,
            )


@triton.jit
def _bucketed_tokens(
    key,
    w,
    cut,
    quota,
    k,
    run,
    run_len,
    ws_ptr,
    marks_off,
    row,
    heavy,
    order_ptr,
    b,
    kvh,
    stride_ob,
    stride_ok,
    pos_row,
    n_sink,
    w_row,
    one,
    with_ones,
    P: tl.constexpr,
    CHUNK: tl.constexpr,
    ONES: tl.constexpr,
):
    """Phase 2: the bucketed tokens of the combinations above the cut and, up to the quota, at it,
    copied from their runs of the inverted lists; returns (n_above, n_tie, tie_lo)."""
    lane = tl.arange(0, CHUNK)
    # Slots [0, k - quota) hold the tokens above the cut, the bucketed
    # ones first; slots [k - quota, k) the ties, the bucketed ones (runs at the cut in
    # combination order, up to the quota) first. The runs above the cut take their offsets
    # from an int32 cumsum; the ties' runs only need one when several combinations score
    # exactly the cut (equal float sums), else the one run at it starts at the first tie
    # slot.
    above = tl.where((w > 0) & (key > cut), run_len, 0)
    # (a block & a scalar bool: Triton 3.9's interpreter would make it int32)
    at_cut = tl.where((w > 0) & (key == cut) & (w * 0 + quota > 0), run_len, 0)
    before = tl.cumsum(above, 0) - above
    n_above, n_at, cut_runs = _sum3(above, at_cut, (at_cut > 0).to(tl.int32))
    n_tie = tl.minimum(n_at, quota)
    tie_lo = k - quota
    tie_before = tl.zeros([P], tl.int32)
    if cut_runs > 1:
        tie_before = tl.cumsum(at_cut, 0) - at_cut
    tie_run = (at_cut > 0) & (tie_before < quota)
    first = tl.where(tie_run, tie_lo + tie_before, before)
    marked = (above > 0) | tie_run
    # A mark with low word 0 (no run's: those are >= 2^31 - heavy) stops the runs at the slots
    # the recent tokens above the cut fill, [n_above, tie_lo).
    stop = n_above < tie_lo
    marks_ws = ws_ptr.to(tl.pointer_type(tl.int64), bitcast=True)
    marks = marks_ws + marks_off // 2 + row.to(tl.int64) * heavy
    tl.store(
        marks + first,
        ((first + 1).to(tl.int64) << 32) | ((run - first).to(tl.int64) + _BIAS),
        mask=marked,
    )
    if stop:
        tl.store(marks + n_above, (n_above + 1).to(tl.int64) << 32)
    tl.debug_barrier()  # every thread's marks are visible to the others after it
    order_row = order_ptr + b.to(tl.int64) * stride_ob + kvh * stride_ok
    carry = tl.full([], 0, tl.int64)
    for j0 in range(0, tie_lo + n_tie, CHUNK):
        j = j0 + lane
        v = tl.load(marks + j, mask=j < tie_lo + n_tie, other=0)
        v = tl.maximum(tl.associative_scan(v, 0, _max_combine), carry)
        carry = tl.max(v, 0)
        low = v - ((v >> 32) << 32)
        ok = (j < tie_lo + n_tie) & (low != 0)
        token = tl.load(order_row + j + (low - _BIAS), mask=ok)
        tl.store(pos_row + n_sink + j, token, mask=ok)
        if ONES:
            tl.store(w_row + token, one, mask=ok & with_ones)
    # Zero the marks for the next call once every thread has read them (zeroing each chunk
    # as it is read races: the scan may take the loads into another layout than the stores)
    tl.debug_barrier()
    tl.store(marks + first, tl.zeros([P], tl.int64), mask=marked)
    if stop:
        tl.store(marks + n_above, tl.zeros([], tl.int64))
    return n_above, n_tie, tie_lo


@triton.jit
def _recent_tokens(
    rec_lo,
    rec_hi,
    code_next,
    codes_row,
    stride_kn,
    stride_km,
    lut_row,
    cut,
    k,
    next_above,
    next_tie,
    ties_left,
    pos_row,
    n_sink,
    w_row,
    one,
    with_ones,
    M: tl.constexpr,
    C: tl.constexpr,
    CHUNK: tl.constexpr,
    ONES: tl.constexpr,
):
    """Phase 3: the recent tokens [frozen, hi), scanned: those above the cut fill the slots from
    next_above, ties the slots from next_tie up to ties_left of them."""
    lane = tl.arange(0, CHUNK)
    # Each step loads the next step's codes before it scores its own, and ranks its tokens only
    # when it takes one.
    m_idx = tl.arange(0, M)
    for start in range(rec_lo, rec_hi, CHUNK):
        offs = start + lane
        cand = offs < rec_hi
        code = code_next
        code_next = load_codes(codes_row, offs + CHUNK, offs + CHUNK < rec_hi, stride_kn, stride_km, M)
        s = tl.zeros([CHUNK], tl.float32)
        for m in tl.static_range(M):
            code_m = tl.sum(tl.where(m_idx[None, :] == m, code, 0), axis=1)
            s += tl.load(lut_row + m * C + code_m, mask=cand, other=0.0)
        key_t = order_key(s)
        is_above = cand & (key_t > cut)
        is_tie = cand & (key_t == cut) & (offs * 0 + ties_left > 0)
        packed = is_above.to(tl.int32) + (is_tie.to(tl.int32) << 16)  # both ranks in one scan
        total = tl.sum(packed, 0)
        if total > 0:
            inclusive = tl.cumsum(packed, 0)
            tie_rank = (inclusive >> 16) - 1
            slot = tl.where(is_above, next_above + (inclusive & 0xFFFF) - 1, next_tie + tie_rank)
            taken = (is_above | (is_tie & (tie_rank < ties_left))) & (slot < k)
            tl.store(pos_row + n_sink + slot, offs, mask=taken)
            if ONES:
                tl.store(w_row + offs, one, mask=taken & with_ones)
        next_above += total & 0xFFFF
        next_tie += total >> 16
        ties_left -= total >> 16


@triton.jit
def _fixed_parts(
    pos_row, n_sink, k, n_win, win_lo, width, w_row, one, with_ones, CHUNK: tl.constexpr, ONES: tl.constexpr
):
    """Phase 4: sink, window and -1 padding; returns the count."""
    lane = tl.arange(0, CHUNK)
    for start in range(0, n_sink, CHUNK):
        o = start + lane
        tl.store(pos_row + o, o, mask=o < n_sink)
        if ONES:
            tl.store(w_row + o, one, mask=(o < n_sink) & with_ones)
    for start in range(0, n_win, CHUNK):
        o = start + lane
        tl.store(pos_row + n_sink + k + o, win_lo + o, mask=o < n_win)
        if ONES:
            tl.store(w_row + win_lo + o, one, mask=(o < n_win) & with_ones)
    count = n_sink + k + n_win
    for start in range(count, width, CHUNK):
        o = start + lane
        tl.store(pos_row + o, tl.full([CHUNK], -1, tl.int32), mask=o < width)
    return count


_pq_bucket_launch = Launcher(_pq_bucket_kernel)
_pq_bucket_select_launch = Launcher(_pq_bucket_select_kernel)


def bucket_tokens(
    codes: torch.Tensor,
    lengths: torch.Tensor,
    order: torch.Tensor,
    starts: torch.Tensor,
    frozen: torch.Tensor,
    cursor: torch.Tensor,
    *,
    C: int,
    window: int,
    cand_lo: int,
) -> None:
    """(Re)build the buckets of the candidate tokens [cand_lo, lengths[b] - window), in place.

    codes [B, Hkv, N, M] uint8 by strides (row r: token r); order [B, Hkv, >= N] int32 with a
    contiguous last dim; starts [B, Hkv, P + 1] int32 and cursor [B, Hkv, P] int32, both
    contiguous; frozen [B] int32. Writes frozen = max(lengths - window, cand_lo), starts from the
    combinations' counts, and each run of `order` (its order inside a run is arbitrary)."""
    B, Hkv, N, M = codes.shape
    P = C**M
    cursor.zero_()
    count_combos(codes, lengths, cursor, C=C, window=window, cand_lo=cand_lo)
    starts[..., 0] = 0
    starts[..., 1:] = cursor.cumsum(-1)
    cursor.copy_(starts[..., :-1])
    frozen.copy_((lengths - window).clamp(min=cand_lo))
    _pq_bucket_launch(
        (B * Hkv, max(-(-N // HIST_TILE), 1)),
        (codes, lengths, cursor, order),
        (*codes.stride(), *order.stride()[:2], Hkv, window, cand_lo),
        dict(M=M, BITS=C.bit_length() - 1, P=P, TILE=HIST_TILE, num_warps=4),
    )


def pq_select_buckets(
    q: torch.Tensor,
    centroids: torch.Tensor,
    codes: torch.Tensor,
    lengths: torch.Tensor,
    params: SelectParams,
    *,
    positions: torch.Tensor,
    counts: torch.Tensor,
    workspace: torch.Tensor,
    histogram: torch.Tensor,
    buckets: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    weights: torch.Tensor | None = None,
    config: triton.Config | None = None,
    after_encode: bool = False,
    new_key: NewKey | None = None,
    zero_programs: int | None = None,
) -> None:
    """Launch the bucket selection on validated inputs (arguments as
    pqattn.kernels.select.hist.pq_select_hist, codes row r holding token r; codes of any integer
    dtype, positions and counts int32 or int64).

    histogram [B, Hkv, C**M] int32: the candidate counts for the current lengths; buckets
    (order, starts, frozen) as `bucket_tokens` left them for these codes, at lengths that are now
    at most `lengths`. workspace: int32, zero-filled once, workspace_numel(B * H, M, C, heavy).
    weights [B, H, n_weights] (last dim contiguous, n_weights >= lengths) or None: 1.0 at the
    selected positions, 0.0 elsewhere. after_encode: the launch ahead of this one is the encode
    launch (pqattn.kernels.encode), which lets it start early (programmatic dependent launch):
    the LUT and the weights' zeros are written while the encode runs. `config`: one of
    BUCKET_CONFIGS (by default `select_config`).
    new_key: the encode launch's work for one new key, done by the selection itself (one launch
    instead of two; see NewKey). zero_programs: programs per row that write the weights' zeros
    beside the row's selection (by default `zero_programs_for`; 0: the selection writes them).
    """
    sink, window, heavy, cand_lo, short_threshold, width = params
    B, H, D = q.shape
    Hkv, M, C = centroids.shape[1], centroids.shape[2], centroids.shape[3]
    P = C**M
    rows = B * H
    if new_key is not None:
        _check_new_key(new_key, q, centroids, codes, window, after_encode)
    _, marks_off, done_off, need = workspace_layout(rows, M, C, heavy)
    if workspace.dtype != torch.int32 or workspace.numel() < need:
        raise ValueError(
            f"workspace: expected int32 with at least {need} elements, got {workspace.dtype} "
            f"with {workspace.numel()}"
        )
    if config is None:
        config = select_config(rows, q.device)
    else:  # one of BUCKET_CONFIGS, or an equal one (its launch options are kept by identity)
        config = next((c for c in BUCKET_CONFIGS if c == config), None)
        if config is None:
            raise ValueError("config: expected one of BUCKET_CONFIGS")
    order, starts, frozen = buckets
    dsub = D // M
    if weights is None:
        zero = 0
    elif zero_programs is None:
        zero = zero_programs_for(rows, q.device)
    elif zero_programs >= 0:
        zero = zero_programs
    else:
        raise ValueError(f"zero_programs: expected >= 0 or None, got {zero_programs}")
    n_weights = 0 if weights is None else weights.shape[2]
    chunk = config.kwargs["CHUNK"]
    zero_span = -(-n_weights // (max(zero, 1) * chunk)) * chunk  # whole chunks (host ints: see decode.py)
    keys = q if new_key is None else new_key.keys
    _pq_bucket_select_launch(
        (rows * (1 + zero),),
        (
            q,
            centroids,
            codes,
            lengths,
            histogram,
            order,
            starts,
            frozen,
            workspace,
            positions,
            counts,
            counts if weights is None else weights,
            keys,
            centroids if new_key is None or new_key.phi is None else new_key.phi,
        ),
        (
            *q.stride()[:2],
            *centroids.stride()[:4],
            *codes.stride(),
            *order.stride()[:2],
            *positions.stride()[:2],
            *((0, 0) if weights is None else weights.stride()[:2]),
            *((0, 0, 0) if new_key is None else (keys.stride(0), keys.stride(1), keys.stride(3))),
            n_weights,
            zero_span,
            rows,
            H,
            H // Hkv,
            Hkv,
            sink,
            window,
            heavy,
            cand_lo,
            short_threshold,
            width,
            marks_off,
            done_off,
            0 if new_key is None else new_key.length - 1,
            0 if new_key is None else new_key.n_drop,
        ),
        dict(
            M=M,
            C=C,
            BITS=C.bit_length() - 1,
            P=P,
            DSUB=dsub,
            BLOCK_D=min(dsub, 64),
            HAS_W=weights is not None,
            ZERO_PROGS=zero,
            ENCODE=new_key is not None,
            IP=centroids.shape[4] == dsub + 1,
            **(pdl_meta(q.device) if after_encode else {"PDL": False}),
            **_CONFIG_KWARGS[id(config)],
        ),
    )


def _check_new_key(
    new_key: NewKey,
    q: torch.Tensor,
    centroids: torch.Tensor,
    codes: torch.Tensor,
    window: int,
    after_encode: bool,
) -> None:
    B, _, D = q.shape
    capacity = codes.shape[2]
    Hkv, M = centroids.shape[1], centroids.shape[2]
    if after_encode:
        raise ValueError("new_key: the selection encodes the key itself; expected after_encode=False")
    if tuple(new_key.keys.shape) != (B, Hkv, 1, D) or new_key.keys.stride(-1) != 1:
        raise ValueError(
            f"new_key.keys: expected [B, Hkv, 1, D] = {[B, Hkv, 1, D]} with a contiguous last dim, "
            f"got {list(new_key.keys.shape)} with strides {new_key.keys.stride()}"
        )
    if not 0 <= new_key.n_drop <= min(2, window - 1):
        raise ValueError(
            f"new_key.n_drop: expected 0 <= n_drop <= min(2, window - 1) = {min(2, window - 1)} (the new "
            f"key in the window, one position changing candidacy), got {new_key.n_drop}"
        )
    if not 1 <= new_key.length <= capacity:
        raise ValueError(
            f"new_key.length: expected 1 <= length <= the codes' rows ({capacity}), got {new_key.length}"
        )
    ip = centroids.shape[4] == D // M + 1
    if ip != (new_key.phi is not None):
        raise ValueError(f"new_key.phi: expected {'[B, Hkv, M]' if ip else 'None'} for these centroids")
