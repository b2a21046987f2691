"""Device helpers of PQ codes shared by the encode kernel and the bucket selection: a key's
sub-vector distances to the centroids (with the query's LUT row from the same loads), its nearest
centroid, and how appending tokens changes the candidates' combination histogram (see
pqattn.kernels.encode's docstring).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def sub_distances(
    x_ptr,
    stride_xd,
    valid,
    cent_m,
    stride_cc,
    phi_m,
    q_ptr,
    C: tl.constexpr,
    DSUB: tl.constexpr,
    BLOCK_D: tl.constexpr,
    IP: tl.constexpr,
    WITH_Q: tl.constexpr,
):
    """(||c||^2 - 2 <x, c> for the centroids c of cent_m [C, DSUB (+1 for ip)] and the sub-vector
    at x_ptr (for ip augmented with sqrt(phi_m[0] - ||x||^2); x reads as zeros unless `valid`),
    and with WITH_Q <q, c[:DSUB]> for the query's sub-vector at q_ptr (a LUT row) from the same
    centroid loads; zeros without)."""
    c_idx = tl.arange(0, C)
    d_idx = tl.arange(0, BLOCK_D)
    dot = tl.zeros([C], dtype=tl.float32)
    c_sq = tl.zeros([C], dtype=tl.float32)
    q_dot = tl.zeros([C], dtype=tl.float32)
    x_sq = tl.zeros([BLOCK_D], dtype=tl.float32)
    for d0 in tl.static_range(0, DSUB, BLOCK_D):
        # (a bound instead of a scalar & block mask: Triton 3.9's interpreter makes that int32)
        x = tl.load(x_ptr + (d0 + d_idx) * stride_xd, mask=d_idx < tl.where(valid, BLOCK_D, 0), other=0.0)
        x = x.to(tl.float32)
        c = tl.load(cent_m + c_idx[:, None] * stride_cc + d0 + d_idx[None, :]).to(tl.float32)
        dot += tl.sum(c * x[None, :], axis=1)
        c_sq += tl.sum(c * c, axis=1)
        x_sq += x * x
        if WITH_Q:
            q_dot += tl.sum(c * tl.load(q_ptr + d0 + d_idx).to(tl.float32)[None, :], axis=1)
    if IP:
        extra = tl.sqrt(tl.maximum(tl.load(phi_m).to(tl.float32) - tl.sum(x_sq, axis=0), 0.0))
        c_extra = tl.load(cent_m + c_idx * stride_cc + DSUB).to(tl.float32)
        dot += extra * c_extra
        c_sq += c_extra * c_extra
    return c_sq - 2.0 * dot, q_dot


@triton.jit
def nearest_code(
    x_ptr,
    stride_xd,
    valid,
    cent_m,
    stride_cc,
    phi_m,
    C: tl.constexpr,
    DSUB: tl.constexpr,
    BLOCK_D: tl.constexpr,
    IP: tl.constexpr,
):
    """The index of the centroid of cent_m nearest to the sub-vector at x_ptr (sub_distances)."""
    dist, _ = sub_distances(
        x_ptr, stride_xd, valid, cent_m, stride_cc, phi_m, x_ptr, C, DSUB, BLOCK_D, IP, False
    )
    return tl.argmin(dist, axis=0, tie_break_left=True)


@triton.jit
def candidacy_changes(
    codes_row,
    stride_on,
    stride_om,
    new,
    t,
    T,
    first,
    n_drop,
    window,
    cand_lo,
    M: tl.constexpr,
    C: tl.constexpr,
):
    """What program t of a write of T tokens at rows `first`.. over n_drop changes in the candidate
    histogram (the module's docstring): (whether its own token is counted, the combination of the
    stored position whose candidacy changes and the change: +1, -1 or 0). codes_row: the codes
    of this (sequence, KV head), row r at r * stride_on."""
    own = new & (t < T - window) & (first + t >= cand_lo)
    # stored positions whose candidacy changes: [e_old, min(e_new, first)) gain it,
    # [e_new, e_old) lose it
    gain = n_drop <= T
    changed = tl.where(gain, tl.minimum(T, window) - n_drop, n_drop - T)
    old = first - window + tl.where(gain, n_drop, T) + t
    change = tl.where((t < changed) & (old >= cand_lo), tl.where(gain, 1, -1), 0)
    old_combo = 0
    for m in tl.static_range(M):
        old_code = tl.load(codes_row + old * stride_on + m * stride_om, mask=change != 0, other=0)
        old_combo = old_combo * C + old_code.to(tl.int32)
    return own, old_combo, change
