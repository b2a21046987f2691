"""Device helpers shared by the selection kernels (`tree`, `hist`, `buckets`, `fine`).

Scores become order-preserving uint32 keys (`order_key`, 0 = not a candidate); a row's lookup
table LUT[m, c] = <q_m, centroid[m, c]> lives in the workspace (`write_lut`, `lut_base`); a top-k
over keys is a count search that keeps a bracket of existing keys (`probe`), and with token counts
per key (the histogram routes) `weighted_cut` finds the cut. The decisions and the searches
measured slower: docs/kernels/select.md and select-log.md.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl


@functools.cache
def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device (launch splits that aim at one wave)."""
    return torch.cuda.get_device_properties(device).multi_processor_count


@triton.jit
def load_codes(codes_row, offs, in_range, stride_kn, stride_km, M: tl.constexpr):
    """codes[token, m] of tokens `offs` as int32 [len(offs), M] (0 outside `in_range`)."""
    m = tl.arange(0, M)
    return tl.load(
        codes_row + offs[:, None] * stride_kn + m[None, :] * stride_km, mask=in_range[:, None], other=0
    ).to(tl.int32)


@triton.jit
def write_lut(
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
    """LUT[m, c] = <q_m, centroid[m, c, :DSUB]> in float32."""
    c_idx = tl.arange(0, C)
    d_idx = tl.arange(0, BLOCK_D)
    for m in tl.static_range(M):
        acc = tl.zeros([C], dtype=tl.float32)
        for d0 in tl.static_range(0, DSUB, BLOCK_D):
            qv = tl.load(q_row + m * DSUB + d0 + d_idx).to(tl.float32)
            cv = tl.load(cent + m * stride_cm + c_idx[:, None] * stride_cc + d0 + d_idx[None, :]).to(
                tl.float32
            )
            acc += tl.sum(cv * qv[None, :], axis=1)
        tl.store(lut_row + m * C + c_idx, acc)


@triton.jit
def lut_base(ws_ptr):
    """The LUTs open the int32 workspace, as float32 (one tensor argument instead of two views:
    slicing the workspace on every call costs host time)."""
    return ws_ptr.to(tl.pointer_type(tl.float32), bitcast=True)


@triton.jit
def order_key(s):
    """uint32 keys ordered like the float32 scores; every score maps above 0 (0 = not a candidate)."""
    bits = s.to(tl.uint32, bitcast=True)
    return tl.where((bits >> 31) != 0, bits ^ 0xFFFFFFFF, bits | 0x80000000)


@triton.jit
def probe(lo, hi, c_lo, c_hi, aim, bisect):
    """The next probe (uint32) of a count search, strictly inside the bracket lo < hi of int64 keys
    with c_lo keys (or tokens) at or above lo and c_hi at or above hi: where `aim` of them would
    lie at or above it if the count fell linearly between the two ends, or the bracket's
    midpoint after a step that did not halve it."""
    frac = (c_lo - aim).to(tl.float32) / (c_lo - c_hi).to(tl.float32)
    guess = lo + ((hi - lo).to(tl.float32) * frac).to(tl.int64)
    probe = tl.where(bisect, (lo + hi) // 2, tl.minimum(tl.maximum(guess, lo + 1), hi - 1))
    return probe.to(tl.uint32)


# Triton's interpreter runs a tuple reduction element by element in Python (minutes per test), so
# under it the three reductions below run separately; compiled, one reduction carries all three.
SEPARATE_REDUCTIONS: tl.constexpr = tl.constexpr(os.environ.get("TRITON_INTERPRET") == "1")


@triton.jit
def _sum_min_max_combine(a0, b0, c0, a1, b1, c1):
    return a0 + a1, tl.minimum(b0, b1), tl.maximum(c0, c1)


@triton.jit
def sum_min_max(a, b, c):
    """(sum of a, min of b, max of c) over the tile, in one reduction when compiled."""
    if SEPARATE_REDUCTIONS:
        return tl.sum(a), tl.min(b), tl.max(c)
    else:
        return tl.reduce((a, b, c), 0, _sum_min_max_combine)


@triton.jit
def code_combination(code, M: tl.constexpr, BITS: tl.constexpr):
    """The combination index sum_m code[:, m] << (BITS * (M-1-m)) of codes [T, M] (int32)."""
    m = tl.arange(0, M)
    weight = tl.full([M], 1, tl.int32) << ((M - 1 - m) * BITS)
    return tl.sum(code * weight[None, :], axis=1)


@triton.jit
def row_need(n, heavy, window, cand_lo):
    """Candidates [cand_lo, n - window) and how many of them the heavy part takes."""
    hi = n - window
    return hi, tl.minimum(heavy, tl.maximum(hi - cand_lo, 0))


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
    """The float32 score of an order_key key (the inverse map)."""
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
    if SEPARATE_REDUCTIONS:
        s1, s2 = tl.sum(moment), tl.sum(moment * score)
    else:
        s1, s2 = tl.reduce((moment, moment * score), 0, _sum_sum_combine)
    n = total.to(tl.float32)
    mean = s1 / n
    kf = k.to(tl.float32)
    sd = tl.sqrt(tl.maximum(s2 / n - mean * mean, 0.0))
    p_hi = order_key(mean + _upper_probit(kf / _SPREAD, n) * sd).to(tl.int64)
    p_lo = order_key(mean + _upper_probit(tl.minimum(kf * _SPREAD, n - 0.5), n) * sd).to(tl.int64)
    return p_hi, p_lo


@triton.jit
def weighted_cut(key, w, need):
    """(cut, quota, k) for keys [P] (0: no candidate; `order_key` of the float32 scores) carrying
    w tokens each: the k = min(need, sum w) largest tokens are all those of keys > cut plus
    `quota` of those of key == cut.

    The search of pqattn.kernels.select.tree._top_k with token counts: a bracket lo < hi of existing
    keys with c_lo = tokens at or above lo > k and c_hi = tokens at or above hi < k; each step
    probes a value inside (`probe`) and snaps the bracket to the nearest keys on either side.
    When a row has at least _NORMAL_MIN_COMBOS combinations and k is at least 1/128 of its
    tokens, the first step probes two values in one reduction: where a normal distribution of the
    scores (the tokens' weighted mean and variance) puts the (k / 1.5)-th and the (1.5 k)-th
    largest, and the bracket usually holds few keys after it. Why these numbers, and the searches
    measured slower (four probes a step, a compacted finish): docs/kernels/select-log.md.
    """
    valid = w > 0
    total, lo, top = sum_min_max(w, tl.where(valid, key, tl.full([], 0xFFFFFFFF, tl.uint32)), key)
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
        p32 = probe(lo, hi, c_lo, c_hi, k, bisect)
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
    if SEPARATE_REDUCTIONS:
        c1, min1, max1 = sum_min_max(w_hi, d_hi, d_hi)
        c2, min2, max2 = sum_min_max(w_lo, d_lo, d_lo)
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
    c, d_min, d_max = sum_min_max(tl.where(key >= p32, w, 0), diff, diff)
    up = c >= k
    lo = tl.where(up, (p32 + d_min).to(tl.int64), lo)
    c_lo = tl.where(up, c, c_lo)
    hi = tl.where(up, hi, (p32 + d_max).to(tl.int64) + 1)
    c_hi = tl.where(up, c_hi, c)
    return lo, hi, c_lo, c_hi
