"""Sparse (weighted) decode attention (SPEC §3): split-K flash decoding over gathered positions.

Grid (splits, B * H): each program takes BLOCK_L consecutive entries of one row's selection list,
gathers their key and value rows (BLOCK_N at a time, one coalesced row of D elements each), and
keeps an online softmax (max, sum, weighted values) in float32 with exp2. Splits past the row's
count do nothing but report an empty partial. With one split the program writes the output; with
several, each writes its partial to the workspace and the last one to arrive at the row's counter
combines them (no second launch, no spin). The grid depends only on the list width L, never on
the counts: no host sync, and the same launch replays from a CUDA graph.
"""

from __future__ import annotations

import functools
import math

import torch
import triton
import triton.language as tl

from pqattn.kernels import paged
from pqattn.runtime.launch import Launcher, TunedLauncher, autotuning, graph_timing

# The autotune space: entries per split, rows gathered per step, warps. Every config is exercised
# by the tests and by `pqattn check`. One warp per program wins on bf16 D=128: many small programs
# keep more gathers in flight per SM. Four warps stay for D=256 and float32, whose rows would not
# fit one warp's registers (docs/kernels/decode.md).
DECODE_CONFIGS = [
    triton.Config({"BLOCK_L": bl, "BLOCK_N": bn}, num_warps=w)
    for bl, bn, w in ((32, 16, 1), (32, 32, 1), (64, 32, 1), (128, 32, 1), (128, 64, 4))
]
_COMBINE = 16  # partials combined per step by the last program of a row
# The combine's steps (COMBINE partials a row, one split a group) are unrolled up to UNROLL_MAX;
# a wider list loops over blocks of UNROLL_BLOCK unrolled steps, since a full unroll's compile
# time grows with the list's width (docs/kernels/decode.md).
_UNROLL_MAX = 64
_UNROLL_BLOCK = 16
_LOG2E = 1.4426950408889634


def split_count(width: int, block_l: int) -> int:
    return max(-(-width // block_l), 1)  # (triton.cdiv is a constexpr function: slow on the host)


@functools.cache  # on every call's path: keep it cheap
def workspace_numel(rows: int, width: int, D: int) -> int:
    """int32 elements of the decode workspace: a counter per row, then float32 partials
    (D values, max, sum) for every split of the smallest BLOCK_L."""
    splits = split_count(width, min(c.kwargs["BLOCK_L"] for c in DECODE_CONFIGS))
    return rows + rows * splits * (D + 2)


@triton.jit
def _sparse_decode_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    pos_ptr,
    cnt_ptr,
    w_ptr,
    out_ptr,
    lse_ptr,
    ws_ptr,
    bt_ptr,
    stride_qb,
    stride_qh,
    stride_kb,
    stride_kh,
    stride_kn,
    stride_vb,
    stride_vh,
    stride_vn,
    stride_pb,
    stride_ph,
    stride_cb,
    stride_ch,
    stride_wb,
    stride_wh,
    stride_wl,
    stride_ob,
    stride_oh,
    stride_tb,
    H,
    G,
    qk_scale,  # scale * log2(e): the logits live in base 2
    WIDTH: tl.constexpr,  # the list width L (a constexpr: the combine below unrolls over the splits)
    D: tl.constexpr,
    HAS_W: tl.constexpr,
    W_DENSE: tl.constexpr,  # weights indexed by token position [B, H, N] instead of by entry [B, H, L]
    HAS_LSE: tl.constexpr,
    PAGE: tl.constexpr,  # tokens per block of a paged cache (SPEC §8); 0: contiguous [B, Hkv, N, D]
    COMBINE: tl.constexpr,
    UNROLL_MAX: tl.constexpr,
    UNROLL_BLOCK: tl.constexpr,
    BLOCK_L: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    SPLITS: tl.constexpr = (WIDTH + BLOCK_L - 1) // BLOCK_L + (WIDTH == 0)  # the grid's axis 0
    split = tl.program_id(0)
    row = tl.program_id(1)
    b = row // H
    h = row % H
    kvh = h // G
    pos_row = pos_ptr + b * stride_pb + h * stride_ph
    lo = split * BLOCK_L
    # The first step's positions are requested before the count is known: the two loads share
    # one latency instead of two on the dependent chain count -> positions -> gathers.
    e = lo + tl.arange(0, BLOCK_N)
    p = tl.load(pos_row + e, mask=e < WIDTH, other=0)
    cnt = tl.minimum(tl.load(cnt_ptr + b * stride_cb + h * stride_ch).to(tl.int32), WIDTH)
    d = tl.arange(0, D)
    q = tl.load(q_ptr + b * stride_qb + h * stride_qh + d).to(tl.float32) * qk_scale
    k_row = paged.cache_base(k_ptr, b, kvh, stride_kb, stride_kh, PAGE)
    v_row = paged.cache_base(v_ptr, b, kvh, stride_vb, stride_vh, PAGE)
    bt_row = bt_ptr + b * stride_tb
    w_row = w_ptr + b * stride_wb + h * stride_wh

    # The workspace: a counter per row, then the float32 partials (one tensor argument instead of
    # two views: slicing it on every call costs host time).
    lock_ptr = ws_ptr
    part_ptr = (ws_ptr + tl.num_programs(1)).to(tl.pointer_type(tl.float32), bitcast=True)
    m = tl.full([], float("-inf"), tl.float32)
    s_sum = tl.zeros([], dtype=tl.float32)
    acc = tl.zeros([D], dtype=tl.float32)
    hi = tl.minimum(lo + BLOCK_L, cnt)
    for start in range(lo, hi, BLOCK_N):
        e = start + tl.arange(0, BLOCK_N)
        ok = e < hi
        at = p.to(tl.int64)  # (past the count p may hold anything: every use below is masked)
        ko, vo = paged.kv_offsets(at, ok, bt_row, stride_kb, stride_kn, stride_vb, stride_vn, PAGE)
        # Both gathers are issued before any reduction: the value rows' latency overlaps the keys'.
        kt = tl.load(k_row + ko[:, None] + d[None, :], mask=ok[:, None], other=0.0)
        vt = tl.load(v_row + vo[:, None] + d[None, :], mask=ok[:, None], other=0.0)
        # the next step's positions, in flight while this step computes
        p = tl.load(pos_row + e + BLOCK_N, mask=e + BLOCK_N < hi, other=0)
        s = tl.sum(kt.to(tl.float32) * q[None, :], axis=1)
        if HAS_W:
            if W_DENSE:
                w = tl.load(w_row + at * stride_wl, mask=ok, other=1.0)
            else:
                w = tl.load(w_row + e * stride_wl, mask=ok, other=1.0)
            s += tl.log2(w.to(tl.float32))
        s = tl.where(ok, s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=0))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # all -inf so far: no NaN from -inf - -inf
        alpha = tl.exp2(m - m_safe)
        pr = tl.exp2(s - m_safe)
        acc = acc * alpha + tl.sum(pr[:, None] * vt.to(tl.float32), axis=0)
        s_sum = s_sum * alpha + tl.sum(pr, axis=0)
        m = m_new

    out_row = out_ptr + b * stride_ob + h * stride_oh
    if SPLITS == 1:
        _finish(out_row, lse_ptr + row, acc, m, s_sum, D, HAS_LSE)
    else:
        part = part_ptr + (row.to(tl.int64) * SPLITS + split) * (D + 2)
        tl.store(part + d, acc)
        tl.store(part + D, m)
        tl.store(part + D + 1, s_sum)
        tl.debug_barrier()  # every thread's partial stores precede the release below
        arrived = tl.atomic_add(lock_ptr + row, 1, sem="acq_rel")
        if arrived == SPLITS - 1:  # the last split of the row combines
            tl.atomic_xchg(lock_ptr + row, 0)  # ready for the next call
            rows = part_ptr + row.to(tl.int64) * SPLITS * (D + 2)
            # One pass, the partials' maxima merged online. The loop is unrolled (SPLITS is a
            # constexpr) so that no chunk's loads wait for the previous chunk's arithmetic.
            m_all = tl.full([], float("-inf"), tl.float32)
            acc = tl.zeros([D], dtype=tl.float32)
            s_sum = tl.zeros([], dtype=tl.float32)
            if SPLITS <= UNROLL_MAX * COMBINE:
                for s0 in tl.static_range(0, SPLITS, COMBINE):
                    acc, s_sum, m_all = _merge_partials(acc, s_sum, m_all, rows, s0, SPLITS, D, COMBINE)
            else:
                for s1 in range(0, SPLITS, UNROLL_BLOCK * COMBINE):
                    for j in tl.static_range(UNROLL_BLOCK):
                        s0 = s1 + j * COMBINE
                        acc, s_sum, m_all = _merge_partials(acc, s_sum, m_all, rows, s0, SPLITS, D, COMBINE)
            _finish(out_row, lse_ptr + row, acc, m_all, s_sum, D, HAS_LSE)


@triton.jit
def _merge_partials(
    acc, s_sum, m_all, rows, s0, SPLITS: tl.constexpr, D: tl.constexpr, COMBINE: tl.constexpr
):
    """Partials s0 .. s0 + COMBINE (those below SPLITS) of a row's [SPLITS, D + 2] (values, max,
    sum) merged into the running (acc, s_sum, m_all), online-softmax style."""
    c = tl.arange(0, COMBINE)
    d = tl.arange(0, D)
    here = s0 + c < SPLITS
    base = rows + (s0 + c) * (D + 2)
    ms = tl.load(base + D, mask=here, other=float("-inf"), cache_modifier=".cg")
    ls = tl.load(base + D + 1, mask=here, other=0.0, cache_modifier=".cg")
    accs = tl.load(base[:, None] + d[None, :], mask=here[:, None], other=0.0, cache_modifier=".cg")
    m_new = tl.maximum(m_all, tl.max(ms, axis=0))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_all - m_safe)
    f = tl.exp2(ms - m_safe)
    acc = acc * alpha + tl.sum(accs * f[:, None], axis=0)
    s_sum = s_sum * alpha + tl.sum(ls * f, axis=0)
    return acc, s_sum, m_new


@triton.jit
def _finish(out_row, lse_at, acc, m, s_sum, D: tl.constexpr, HAS_LSE: tl.constexpr):
    """out = acc / sum (a zero row when nothing was attended); lse in natural log (-inf when empty)."""
    d = tl.arange(0, D)
    inv = tl.where(s_sum > 0, 1.0 / tl.where(s_sum > 0, s_sum, 1.0), 0.0)
    tl.store(out_row + d, (acc * inv).to(out_row.dtype.element_ty))
    if HAS_LSE:
        lse = tl.where(s_sum > 0, (m + tl.log2(s_sum)) * 0.6931471805599453, float("-inf"))
        tl.store(lse_at, lse)


# The group kernel's space (entries per split, rows gathered per step, warps): G query rows share
# each gathered key and value row, as one [GP, BLOCK_N] tensor-core product a step. Longer splits
# serve wide lists: the last program merges one partial a split (docs/kernels/decode.md).
GROUP_DECODE_CONFIGS = [
    triton.Config({"BLOCK_L": bl, "BLOCK_N": bn}, num_warps=w)
    for bl, bn, w in ((256, 64, 4), (256, 128, 8), (512, 64, 4), (1024, 64, 4))
]


# The dense space (entries per split, rows a step, warps): with DENSE a split is a contiguous run
# of the cache's rows, so its loads are issued without waiting on positions, and the longer splits
# a whole cache needs keep the last program's merge short (docs/kernels/decode.md).
DENSE_DECODE_CONFIGS = [
    triton.Config({"BLOCK_L": bl, "BLOCK_N": bn}, num_warps=w)
    for bl, bn, w in ((2048, 128, 8), (2048, 64, 4), (4096, 64, 4), (4096, 128, 8))
]
# Float32 products: the three-stage configs above stage more contiguous rows than an SM's shared
# memory holds; two stages of 64 rows fit up to D=256 (bench/decode_smem.py).
DENSE_WIDE_CONFIGS = [
    triton.Config({"BLOCK_L": bl, "BLOCK_N": 64}, num_warps=4, num_stages=2) for bl in (2048, 4096)
]


_SMALLEST_GROUP_BLOCK_L = min(c.kwargs["BLOCK_L"] for c in GROUP_DECODE_CONFIGS)
_SMALLEST_DENSE_BLOCK_L = min(c.kwargs["BLOCK_L"] for c in DENSE_DECODE_CONFIGS + DENSE_WIDE_CONFIGS)

# A dense list's width (a constexpr: the combine unrolls over the splits) is the cache's tokens
# rounded up to DENSE_WIDTH_STEP, so that a cache growing a token a step (transformers' dynamic
# cache) compiles anew every DENSE_WIDTH_STEP tokens rather than at every step; the kernel clamps
# the counts to the cache's own tokens, so the rows past them are never read.
DENSE_WIDTH_STEP = 4096


def dense_width(tokens: int) -> int:
    """The list width of dense decoding over a cache of `tokens` slots."""
    return -(-tokens // DENSE_WIDTH_STEP) * DENSE_WIDTH_STEP


@functools.cache  # on every eager dense call's path (a growing cache's workspace check)
def group_workspace_numel(groups: int, G: int, width: int, D: int, dense: bool = False) -> int:
    """int32 elements of the group decode workspace: a counter per group, then float32 partials
    (D values, max, sum per query row) for every split of the smallest BLOCK_L of the space.
    dense: width is the cache's tokens, decoded densely (a list of `dense_width(width)`)."""
    if dense:
        splits = split_count(dense_width(width), _SMALLEST_DENSE_BLOCK_L)
    else:
        splits = split_count(width, _SMALLEST_GROUP_BLOCK_L)
    return groups + groups * splits * max(triton.next_power_of_2(G), 16) * (D + 2)


@triton.jit
def _group_decode_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    pos_ptr,
    cnt_ptr,
    out_ptr,
    lse_ptr,
    ws_ptr,
    bt_ptr,
    stride_qb,
    stride_qh,
    stride_kb,
    stride_kh,
    stride_kn,
    stride_vb,
    stride_vh,
    stride_vn,
    stride_pb,
    stride_ph,
    stride_cb,
    stride_ch,
    stride_ob,
    stride_oh,
    stride_tb,
    HKV,
    G,
    qk_scale,  # scale * log2(e)
    entries,  # the list's entries: its width, or with DENSE the cache's tokens (WIDTH rounds it up)
    WIDTH: tl.constexpr,
    D: tl.constexpr,
    GP: tl.constexpr,  # query rows of a program: G padded to a power of two of at least 16
    F32_DOTS: tl.constexpr,  # products in float32 (a float32 cache, or q of another dtype)
    HAS_LSE: tl.constexpr,
    PAGE: tl.constexpr,
    DENSE: tl.constexpr,  # the first counts tokens of the cache, in order (no positions read)
    STARTS: tl.constexpr,  # with DENSE: tokens starts[b] .. counts[b] - 1 (starts [B] at pos_ptr)
    UNROLL_MAX: tl.constexpr,
    UNROLL_BLOCK: tl.constexpr,
    BLOCK_L: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """Sparse decode over a selection shared by a KV head's G query heads (SPEC §7 group): each
    gathered key and value row serves the G heads, as split-K flash decoding with the combine of
    `_sparse_decode_kernel`. With DENSE the list is the cache itself (entry e is token e, or
    starts[b] + e with STARTS): dense decoding, whose rows' addresses need no load."""
    SPLITS: tl.constexpr = (WIDTH + BLOCK_L - 1) // BLOCK_L + (WIDTH == 0)
    split = tl.program_id(0)
    row = tl.program_id(1)
    b = row // HKV
    kvh = row % HKV
    g = tl.arange(0, GP)
    d = tl.arange(0, D)
    heads = kvh * G + g
    q = tl.load(
        q_ptr + b * stride_qb + heads[:, None] * stride_qh + d[None, :], mask=(g < G)[:, None], other=0.0
    )
    pos_row = pos_ptr + b * stride_pb + kvh * stride_ph
    cnt = tl.minimum(tl.load(cnt_ptr + b * stride_cb + kvh * stride_ch).to(tl.int32), entries)
    skip = cnt * 0  # tokens before the sequence's first (STARTS): its entries are the rest
    if STARTS:
        skip = tl.minimum(tl.load(pos_ptr + b * stride_pb).to(tl.int32), cnt)
        cnt -= skip
    k_row = paged.cache_base(k_ptr, b, kvh, stride_kb, stride_kh, PAGE)
    v_row = paged.cache_base(v_ptr, b, kvh, stride_vb, stride_vh, PAGE)
    bt_row = bt_ptr + b * stride_tb
    q = q.to(tl.float32) if F32_DOTS else q.to(k_ptr.dtype.element_ty)
    m = tl.full([GP], float("-inf"), tl.float32)
    s_sum = tl.zeros([GP], dtype=tl.float32)
    acc = tl.zeros([GP, D], dtype=tl.float32)
    lo = split * BLOCK_L
    hi = tl.minimum(lo + BLOCK_L, cnt)
    for start in range(lo, hi, BLOCK_N):
        e = start + tl.arange(0, BLOCK_N)
        ok = e < hi
        at = (e + skip).to(tl.int64) if DENSE else tl.load(pos_row + e, mask=ok, other=0).to(tl.int64)
        ko, vo = paged.kv_offsets(at, ok, bt_row, stride_kb, stride_kn, stride_vb, stride_vn, PAGE)
        kt = tl.load(k_row + ko[:, None] + d[None, :], mask=ok[:, None], other=0.0)
        vt = tl.load(v_row + vo[:, None] + d[None, :], mask=ok[:, None], other=0.0)
        if F32_DOTS:
            s = tl.dot(q, tl.trans(kt.to(tl.float32)), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(kt))
        s = tl.where(ok[None, :], s * qk_scale, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m - m_safe)
        pr = tl.exp2(s - m_safe[:, None])
        if F32_DOTS:
            pv = tl.dot(pr, vt.to(tl.float32), input_precision="ieee")
        else:
            pv = tl.dot(pr.to(vt.dtype), vt)
        acc = acc * alpha[:, None] + pv
        s_sum = s_sum * alpha + tl.sum(pr, axis=1)
        m = m_new

    out_rows = out_ptr + b * stride_ob + heads * stride_oh
    lse_at = lse_ptr + b * HKV * G + heads
    if SPLITS == 1:
        _finish_group(out_rows, lse_at, g < G, acc, m, s_sum, D, HAS_LSE)
    else:
        lock_ptr = ws_ptr
        part_ptr = (ws_ptr + tl.num_programs(1)).to(tl.pointer_type(tl.float32), bitcast=True)
        # the partials of the G real rows only (the padding rows' are never read)
        real = g < G
        part = part_ptr + ((row.to(tl.int64) * SPLITS + split) * GP + g) * (D + 2)
        tl.store(part[:, None] + d[None, :], acc, mask=real[:, None])
        tl.store(part + D, m, mask=real)
        tl.store(part + D + 1, s_sum, mask=real)
        tl.debug_barrier()  # every thread's partial stores precede the release below
        arrived = tl.atomic_add(lock_ptr + row, 1, sem="acq_rel")
        if arrived == SPLITS - 1:  # the last split of the group combines
            tl.atomic_xchg(lock_ptr + row, 0)
            first = part_ptr + (row.to(tl.int64) * SPLITS * GP + g) * (D + 2)
            m_all = tl.full([GP], float("-inf"), tl.float32)
            acc = tl.zeros([GP, D], dtype=tl.float32)
            s_sum = tl.zeros([GP], dtype=tl.float32)
            if SPLITS <= UNROLL_MAX:  # unrolled: no split's loads wait on another's sums
                for sp in tl.static_range(SPLITS):
                    acc, s_sum, m_all = _merge_group_partial(
                        acc, s_sum, m_all, first, sp, real, SPLITS, GP, D
                    )
            else:
                for s0 in range(0, SPLITS, UNROLL_BLOCK):
                    for j in tl.static_range(UNROLL_BLOCK):
                        acc, s_sum, m_all = _merge_group_partial(
                            acc, s_sum, m_all, first, s0 + j, real, SPLITS, GP, D
                        )
            _finish_group(out_rows, lse_at, g < G, acc, m_all, s_sum, D, HAS_LSE)


@triton.jit
def _merge_group_partial(
    acc, s_sum, m_all, first, sp, real, SPLITS: tl.constexpr, GP: tl.constexpr, D: tl.constexpr
):
    """Split sp's partial (its [GP] rows' values, max and sum; none at or past SPLITS, none for
    rows that are not `real`) of a group merged into the running (acc, s_sum, m_all),
    online-softmax style."""
    d = tl.arange(0, D)
    here = ((sp + tl.zeros([GP], dtype=tl.int32)) < SPLITS) & real
    base = first + sp * GP * (D + 2)
    ms = tl.load(base + D, mask=here, other=float("-inf"), cache_modifier=".cg")
    ls = tl.load(base + D + 1, mask=here, other=0.0, cache_modifier=".cg")
    accs = tl.load(base[:, None] + d[None, :], mask=here[:, None], other=0.0, cache_modifier=".cg")
    m_new = tl.maximum(m_all, ms)
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_all - m_safe)
    f = tl.exp2(ms - m_safe)
    acc = acc * alpha[:, None] + accs * f[:, None]
    s_sum = s_sum * alpha + ls * f
    return acc, s_sum, m_new


@triton.jit
def _finish_group(out_rows, lse_at, ok, acc, m, s_sum, D: tl.constexpr, HAS_LSE: tl.constexpr):
    """`_finish` for a group's query rows (rows past G are padding)."""
    d = tl.arange(0, D)
    inv = tl.where(s_sum > 0, 1.0 / tl.where(s_sum > 0, s_sum, 1.0), 0.0)
    tl.store(
        out_rows[:, None] + d[None, :], (acc * inv[:, None]).to(out_rows.dtype.element_ty), mask=ok[:, None]
    )
    if HAS_LSE:
        lse = tl.where(s_sum > 0, (m + tl.log2(s_sum)) * 0.6931471805599453, float("-inf"))
        tl.store(lse_at, lse, mask=ok)


# Each config timed by graph replay, in interleaved rounds: single timed calls after an L2 flush
# misranked the configs in some processes (docs/kernels/decode.md).
_TUNING_ROUNDS = 3
_bench_round = graph_timing(rep=20)


sparse_decode_autotuned = triton.autotune(
    configs=DECODE_CONFIGS, key=["WIDTH", "D", "H", "G", "HAS_W", "W_DENSE", "PAGE"], do_bench=_bench_round
)(_sparse_decode_kernel)
sparse_decode_tuned = TunedLauncher(sparse_decode_autotuned, rounds=_TUNING_ROUNDS)
_sparse_decode_launch = Launcher(_sparse_decode_kernel)
group_decode_autotuned = triton.autotune(
    configs=GROUP_DECODE_CONFIGS, key=["WIDTH", "D", "GP", "F32_DOTS", "PAGE"], do_bench=_bench_round
)(_group_decode_kernel)
group_decode_tuned = TunedLauncher(group_decode_autotuned, rounds=_TUNING_ROUNDS)
dense_decode_autotuned = triton.autotune(
    configs=DENSE_DECODE_CONFIGS, key=["WIDTH", "D", "GP", "F32_DOTS", "PAGE"], do_bench=_bench_round
)(_group_decode_kernel)
dense_decode_tuned = TunedLauncher(dense_decode_autotuned, rounds=_TUNING_ROUNDS)
dense_wide_autotuned = triton.autotune(
    configs=DENSE_WIDE_CONFIGS, key=["WIDTH", "D", "GP", "F32_DOTS", "PAGE"], do_bench=_bench_round
)(_group_decode_kernel)
dense_wide_tuned = TunedLauncher(dense_wide_autotuned, rounds=_TUNING_ROUNDS)
_group_decode_launch = Launcher(_group_decode_kernel)


def sparse_decode(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    counts: torch.Tensor,
    *,
    out: torch.Tensor,
    workspace: torch.Tensor,
    weights: torch.Tensor | None = None,
    dense_weights: bool = False,
    lse: torch.Tensor | None = None,
    scale: float | None = None,
    block_table: torch.Tensor | None = None,
    config: triton.Config | None = None,
) -> None:
    """Launch on validated inputs, writing `out` (and `lse`).

    q [B, H, D] (D a power of two, last dim contiguous); k, v [B, Hkv, N, D] (last dim contiguous);
    positions [B, H, L] int32/int64, the first counts[b, h] entries valid; counts [B, H]; out
    [B, H, D] (last dim contiguous); workspace: int32, zero-filled once, at least
    workspace_numel(B * H, L, D) elements (the kernel leaves its counters at zero); weights
    [B, H, L] per entry, or [B, H, N] by token position when `dense_weights`; lse [B * H] float32
    contiguous or None. With `block_table` [B, max_blocks] int32/int64, k and v are paged caches
    [num_blocks, P, Hkv, D] (SPEC §8). `config` forces one config of DECODE_CONFIGS (the first when not
    `autotuning()`); by default the autotuner picks. L is a compile-time constant: each list width
    compiles once (a model's sink + heavy + window is fixed).
    """
    B, H, D = q.shape
    Hkv = k.shape[2] if block_table is not None else k.shape[1]
    width = positions.shape[-1]
    need = workspace_numel(B * H, width, D)
    if workspace.dtype != torch.int32 or workspace.numel() < need:
        raise ValueError(
            f"workspace: expected int32 with at least {need} elements, got {workspace.dtype} "
            f"with {workspace.numel()}"
        )
    if config is None and not autotuning():
        config = DECODE_CONFIGS[0]
    rows = B * H
    w = weights if weights is not None else positions  # (not read without weights)
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    bt = block_table if block_table is not None else counts  # (not read unpaged)
    tensors = (q, k, v, positions, counts, w, out, lse if lse is not None else workspace, workspace, bt)
    scalars = (
        *q.stride()[:2],
        *paged.cache_strides(k, block_table),
        *paged.cache_strides(v, block_table),
        *positions.stride()[:2],
        *counts.stride(),
        *w.stride(),
        *out.stride()[:2],
        bt.stride(0),
        H,
        H // Hkv,
        scale * _LOG2E,
    )
    meta = dict(
        WIDTH=width,
        D=D,
        HAS_W=weights is not None,
        W_DENSE=dense_weights,
        HAS_LSE=lse is not None,
        PAGE=k.shape[1] if block_table is not None else 0,
        COMBINE=_COMBINE,
        UNROLL_MAX=_UNROLL_MAX,
        UNROLL_BLOCK=_UNROLL_BLOCK,
    )
    if config is None:
        # tuned per width and per grid rows (to a power of two): a row's best split depends on how
        # many programs the batch puts on the SMs
        key = (
            width,
            D,
            H,
            H // Hkv,
            weights is not None,
            dense_weights,
            meta["PAGE"],
            triton.next_power_of_2(rows),
        )
        sparse_decode_tuned(key, lambda c: (split_count(width, c["BLOCK_L"]), rows), tensors, scalars, meta)
    else:
        grid = (split_count(width, config.kwargs["BLOCK_L"]), rows)
        _sparse_decode_launch(grid, tensors, scalars, {**meta, **config.all_kwargs()})


def group_decode(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor | None,
    counts: torch.Tensor,
    *,
    out: torch.Tensor,
    workspace: torch.Tensor,
    lse: torch.Tensor | None = None,
    scale: float | None = None,
    block_table: torch.Tensor | None = None,
    starts: torch.Tensor | None = None,
    config: triton.Config | None = None,
) -> None:
    """Launch on validated inputs: as `sparse_decode`, with positions [B, Hkv, L] and counts
    [B, Hkv] shared by each KV head's G query heads; workspace at least
    `group_workspace_numel(B * Hkv, G, L, D)` int32 elements, zero-filled once. positions None:
    dense decoding over the first counts[b, kvh] tokens of the cache (L = the cache's tokens;
    DENSE_DECODE_CONFIGS, or DENSE_WIDE_CONFIGS for float32 products), or over tokens starts[b] ..
    counts[b, kvh] - 1 with starts [B]."""
    B, H, D = q.shape
    paged_cache = block_table is not None
    Hkv = k.shape[2] if paged_cache else k.shape[1]
    G = H // Hkv
    dense = positions is None
    entries = (
        (block_table.shape[1] * k.shape[1] if paged_cache else k.shape[2]) if dense else positions.shape[-1]
    )
    width = dense_width(entries) if dense else entries
    need = group_workspace_numel(B * Hkv, G, entries, D, dense=dense)
    if workspace.dtype != torch.int32 or workspace.numel() < need:
        raise ValueError(
            f"workspace: expected int32 with at least {need} elements, got {workspace.dtype} "
            f"with {workspace.numel()}"
        )
    f32 = k.dtype == torch.float32 or q.dtype != k.dtype
    wide = dense and f32
    tuned = dense_wide_tuned if wide else dense_decode_tuned if dense else group_decode_tuned
    if config is None and not autotuning():
        config = tuned.autotuned.configs[0]
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    gp = max(triton.next_power_of_2(G), 16)
    bt = block_table if block_table is not None else counts  # (not read unpaged)
    if starts is not None and not dense:
        raise ValueError("starts: only for dense decoding (positions None)")
    pos = positions if not dense else counts if starts is None else starts  # (counts: not read)
    tensors = (q, k, v, pos, counts, out, lse if lse is not None else workspace, workspace, bt)
    scalars = (
        *q.stride()[:2],
        *paged.cache_strides(k, block_table),
        *paged.cache_strides(v, block_table),
        *(positions.stride()[:2] if not dense else (0, 0) if starts is None else (starts.stride(0), 0)),
        *counts.stride(),
        *out.stride()[:2],
        bt.stride(0),
        Hkv,
        G,
        scale * _LOG2E,
        entries,
    )
    page = k.shape[1] if block_table is not None else 0
    meta = dict(WIDTH=width, D=D, GP=gp, F32_DOTS=f32, HAS_LSE=lse is not None, PAGE=page, DENSE=dense)
    meta |= dict(STARTS=starts is not None)
    meta |= dict(UNROLL_MAX=_UNROLL_MAX, UNROLL_BLOCK=_UNROLL_BLOCK)
    if config is None:
        # tuned per width (a dense one to a power of two: a growing cache tunes once an octave)
        # and per grid rows (to a power of two): a row's best split depends on how many programs
        # the batch puts on the SMs
        tuned_width = triton.next_power_of_2(width) if dense else width
        key = (tuned_width, D, gp, f32, page, triton.next_power_of_2(B * Hkv))
        tuned(key, lambda c: (split_count(width, c["BLOCK_L"]), B * Hkv), tensors, scalars, meta)
    else:
        grid = (split_count(width, config.kwargs["BLOCK_L"]), B * Hkv)
        _group_decode_launch(grid, tensors, scalars, {**meta, **config.all_kwargs()})
