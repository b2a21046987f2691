"""Fused PQ top-k selection for one decode query per sequence (SPEC §2), and PQ encoding of new keys.

Selection, one program per (sequence, query head):
  1. the lookup table LUT[m, c] = <q_m, centroid[m, c]> (M x C floats, kept in a workspace that
     stays in L1);
  2. an exact radix select of the `heavy`-th largest score over the candidates: scores are
     recomputed from the uint8 codes on every pass (2-16 bytes per token instead of 4 per token
     per head for materialized scores), mapped to order-preserving uint32 keys, and histogrammed
     12 + 12 + 8 bits at a time, each pass keeping only the keys that share the prefix found so
     far; a pass is skipped once the threshold bin holds exactly the tokens still needed;
  3. one collection pass writes sink, heavy (key above the threshold, or equal to it while ties
     are still needed) and window positions, the count, -1 padding and, when asked, the dense 0/1
     weight row.
No host sync, no allocation beyond what the caller passes in, the same launch every step: the
call can be captured in a CUDA graph.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

# The autotune space. Every config is exercised by the tests and by `pqattn check`.
# The radix digits are 8 bits (four histogram passes of 256 bins): 12-bit digits (4096 bins)
# measured 5-8x slower at every shape on an H200, tl.histogram's cost growing with the bin count
# (bench/select_configs.py at commit 20bb2a5, results in bench/tuning/).
SELECT_CONFIGS = [
    triton.Config({"BLOCK_N": block}, num_warps=warps)
    for block, warps in ((1024, 4), (1024, 8), (2048, 8), (4096, 16))
]


@triton.jit
def _scores(codes_row, lut_row, offs, in_range, stride_kn, stride_km, M: tl.constexpr, C: tl.constexpr):
    """Approximate scores of tokens `offs`: sum over m of LUT[m, code[token, m]]."""
    m = tl.arange(0, M)
    code = tl.load(
        codes_row + offs[:, None] * stride_kn + m[None, :] * stride_km, mask=in_range[:, None], other=0
    ).to(tl.int32)
    return tl.sum(tl.load(lut_row + m[None, :] * C + code), axis=1)


@triton.jit
def _order_key(s):
    """uint32 keys ordered like the float32 scores (flip negatives, set the sign bit of positives)."""
    bits = s.to(tl.uint32, bitcast=True)
    return tl.where((bits >> 31) != 0, bits ^ 0xFFFFFFFF, bits | 0x80000000)


@triton.jit
def _radix_pass(
    codes_row,
    lut_row,
    stride_kn,
    stride_km,
    lo,
    hi,
    prefix,
    pmask,
    remaining,
    M: tl.constexpr,
    C: tl.constexpr,
    SHIFT: tl.constexpr,
    NBITS: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """Histogram the next NBITS of the keys that share `prefix`; narrow the prefix to the threshold bin."""
    NB: tl.constexpr = 1 << NBITS
    hist = tl.zeros([NB], dtype=tl.int32)
    for start in range(lo, hi, BLOCK_N):
        offs = start + tl.arange(0, BLOCK_N)
        inside = offs < hi
        key = _order_key(_scores(codes_row, lut_row, offs, inside, stride_kn, stride_km, M, C))
        match = inside & ((key & pmask) == prefix)
        digit = ((key >> SHIFT) & (NB - 1)).to(tl.int32)
        hist += tl.histogram(digit, NB, mask=match)
    at_or_above = tl.cumsum(hist, 0, reverse=True)  # tokens with a digit >= d
    bins = tl.arange(0, NB)
    d = tl.sum((at_or_above >= remaining).to(tl.int32)) - 1
    in_bin = tl.sum(tl.where(bins == d, hist, 0))
    above = tl.sum(tl.where(bins == d, at_or_above, 0)) - in_bin
    prefix = prefix | (d.to(tl.uint32) << SHIFT)
    pmask = pmask | tl.full([], (NB - 1) << SHIFT, tl.uint32)
    return prefix, pmask, remaining - above, in_bin == remaining - above


@triton.jit
def _pq_select_kernel(
    q_ptr,
    cent_ptr,
    codes_ptr,
    len_ptr,
    lut_ptr,
    pos_ptr,
    cnt_ptr,
    w_ptr,
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
    stride_pb,
    stride_ph,
    stride_wb,
    stride_wh,
    H,
    G,
    n_weights,
    sink,
    window,
    heavy,
    cand_lo,
    short_threshold,
    width,
    code_base,
    n_bucket,  # autotune key only: the power of two above the longest sequence
    M: tl.constexpr,
    C: tl.constexpr,
    DSUB: tl.constexpr,
    BLOCK_D: tl.constexpr,
    HAS_W: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    row = tl.program_id(0)
    b = row // H
    h = row % H
    kvh = h // G
    n = tl.load(len_ptr + b).to(tl.int32)
    pos_row = pos_ptr + b * stride_pb + h * stride_ph
    w_row = w_ptr + b * stride_wb + h * stride_wh
    lane = tl.arange(0, BLOCK_N)

    if n <= short_threshold:  # short sequence: every token
        for start in range(0, width, BLOCK_N):
            offs = start + lane
            tl.store(pos_row + offs, tl.where(offs < n, offs, -1), mask=offs < width)
        tl.store(cnt_ptr + b * H + h, n)
        if HAS_W:
            for start in range(0, n_weights, BLOCK_N):
                offs = start + lane
                tl.store(
                    w_row + offs,
                    tl.where(offs < n, 1.0, 0.0).to(w_ptr.dtype.element_ty),
                    mask=offs < n_weights,
                )
    else:
        # 1. LUT[m, c] = <q_m, centroid[m, c, :DSUB]>, written once, gathered from L1 below.
        lut_row = lut_ptr + row * (M * C)
        c_idx = tl.arange(0, C)
        d_idx = tl.arange(0, BLOCK_D)
        q_row = q_ptr + b * stride_qb + h * stride_qh
        cent = cent_ptr + b * stride_cb + kvh * stride_ck
        for m in tl.static_range(M):
            acc = tl.zeros([C], dtype=tl.float32)
            for d0 in tl.static_range(0, DSUB, BLOCK_D):
                qv = tl.load(q_row + m * DSUB + d0 + d_idx).to(tl.float32)
                cv = tl.load(cent + m * stride_cm + c_idx[:, None] * stride_cc + d0 + d_idx[None, :]).to(
                    tl.float32
                )
                acc += tl.sum(cv * qv[None, :], axis=1)
            tl.store(lut_row + m * C + c_idx, acc)
        tl.debug_barrier()

        # 2. Threshold of the heavy part by radix select over the candidates [cand_lo, n - window).
        # Row r of the codes holds token code_base + r; only tokens >= cand_lo >= code_base are read.
        codes_row = codes_ptr + b * stride_kb + kvh * stride_kk - code_base * stride_kn
        hi = n - window
        n_cand = tl.maximum(hi - cand_lo, 0)
        need = tl.minimum(heavy, n_cand)
        prefix = tl.full([], 0, tl.uint32)
        pmask = tl.full([], 0, tl.uint32)
        remaining = need
        done = (need == n_cand) | (heavy == 0)  # all or none of the candidates: no threshold to find
        for p in tl.static_range(4):  # 8-bit digits, most significant first
            if not done:
                prefix, pmask, remaining, done = _radix_pass(
                    codes_row,
                    lut_row,
                    stride_kn,
                    stride_km,
                    cand_lo,
                    hi,
                    prefix,
                    pmask,
                    remaining,
                    M,
                    C,
                    24 - 8 * p,
                    8,
                    BLOCK_N,
                )

        # 3. Positions: sink [0, n_sink), heavy, window [win_lo, n); count; -1 padding; weights.
        n_sink = tl.minimum(sink, n)
        win_lo = tl.maximum(n - window, n_sink)
        for start in range(0, n_sink, BLOCK_N):
            offs = start + lane
            tl.store(pos_row + offs, offs, mask=offs < n_sink)
        base = n_sink
        ties_taken = 0
        end = hi
        if HAS_W:
            end = n_weights
        for start in range(0, end, BLOCK_N):
            offs = start + lane
            cand = (offs >= cand_lo) & (offs < hi)
            key = _order_key(_scores(codes_row, lut_row, offs, cand, stride_kn, stride_km, M, C)) & pmask
            tie = cand & (key == prefix)
            tie_rank = ties_taken + tl.cumsum(tie.to(tl.int32), 0) - 1
            take = (cand & (key > prefix)) | (tie & (tie_rank < remaining))
            slot = base + tl.cumsum(take.to(tl.int32), 0) - 1
            tl.store(pos_row + slot, offs, mask=take)
            base += tl.sum(take.to(tl.int32))
            ties_taken += tl.sum(tie.to(tl.int32))
            if HAS_W:
                keep = take | (offs < n_sink) | ((offs >= win_lo) & (offs < n))
                tl.store(
                    w_row + offs, tl.where(keep, 1.0, 0.0).to(w_ptr.dtype.element_ty), mask=offs < n_weights
                )
        n_win = n - win_lo
        for start in range(0, n_win, BLOCK_N):
            offs = start + lane
            tl.store(pos_row + base + offs, win_lo + offs, mask=offs < n_win)
        count = base + n_win
        for start in range(count, width, BLOCK_N):
            offs = start + lane
            tl.store(pos_row + offs, tl.full([BLOCK_N], -1, tl.int32), mask=offs < width)
        tl.store(cnt_ptr + b * H + h, count)


_pq_select_autotuned = triton.autotune(configs=SELECT_CONFIGS, key=["n_bucket", "H", "M", "C", "HAS_W"])(
    _pq_select_kernel
)


def interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def pq_select(
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
    lut: torch.Tensor,
    weights: torch.Tensor | None = None,
    code_base: int = 0,
    n_bucket: int,
    config: triton.Config | None = None,
) -> None:
    """Launch the selection on validated inputs, writing `positions`, `counts` (and `weights`).

    q [B, H, D]; centroids [B, Hkv, M, C, >= dsub] (last dim contiguous); codes: any strides with
    codes[b, kvh, n, m] addressed by `codes.stride()` in the order (B, Hkv, N, M); lengths [B];
    positions [B, H, width] int32; counts [B, H] int32 contiguous; lut [B * H * M * C] float32;
    weights [B, H, n_weights] or None; codes row r holds token code_base + r (needs
    cand_lo >= code_base). `config` forces one config of SELECT_CONFIGS; by default
    the autotuner picks (the first config under the Triton interpreter).
    """
    B, H, D = q.shape
    Hkv, M, C = centroids.shape[1], centroids.shape[2], centroids.shape[3]
    dsub = D // M
    if interpreted() and config is None:
        config = SELECT_CONFIGS[0]
    w = weights if weights is not None else counts
    args = (
        q,
        centroids,
        codes,
        lengths,
        lut,
        positions,
        counts,
        w,
        q.stride(0),
        q.stride(1),
        centroids.stride(0),
        centroids.stride(1),
        centroids.stride(2),
        centroids.stride(3),
        *codes.stride(),
        positions.stride(0),
        positions.stride(1),
        w.stride(0),
        w.stride(1),
        H,
        H // Hkv,
        weights.shape[2] if weights is not None else 0,
        sink,
        window,
        heavy,
        cand_lo,
        short_threshold,
        width,
        code_base,
        n_bucket,
    )
    meta = dict(M=M, C=C, DSUB=dsub, BLOCK_D=min(dsub, 64), HAS_W=weights is not None)
    grid = (B * H,)
    if config is None:
        _pq_select_autotuned[grid](*args, **meta)
    else:
        _pq_select_kernel[grid](*args, **meta, **config.kwargs, num_warps=config.num_warps)
