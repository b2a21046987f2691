"""The PQ index build (SPEC §1) on the GPU: the Lloyd loop as one launch per iteration.

Every (b, kv-head, sub-vector m) is a k-means group g = (b * Hkv + kvh) * M + m. A build is
  - one pass for the points' squared norms (and the ip metric's phi), one launch placing the
    initial centres (the reference's seeded stratified draw, hashed in the kernel);
  - one launch per Lloyd iteration: P programs per group, each over a contiguous share of the
    group's tokens, read from the key cache in place (no float32 copy, no gathered points):
      1. distances to all C centres through tensor-core products (|c|^2 - 2 x.c), the nearest
         centre and its squared distance (the codes, straight into the [B, Hkv, N, M] uint8
         layout, are written by the last launch only);
      2. per-centre sums (the one-hot matrix's transposed product with the points), counts and
         ip coordinate sums (its product with a few extra columns, which narrow sub-vectors
         carry in the points' own zero padding), the objective, written as this program's partial;
      3. the group's last program to finish (an acq_rel counter, as in the decode kernel's split
         combine) sums the P partials in program order, computes the new centres, reseeds empty
         clusters (the farthest points first, like the reference) and the early-stop flag.
Nothing waits on the host: iterations are launched back to back, and a group that has
stopped skips its work (its assignment could not change). No float atomics: a seeded build gives
the same index on every run. P fills one wave at the compiled kernel's occupancy.

Precision: x.c must be float32-accurate (tf32 alone cost the selection much of its attention
mass). Keys in bf16/fp16 are exact operands of their own tensor-core dtype, so the centres are
split into 3 bf16 (or 2 fp16) parts whose products with x sum, in float32 accumulation, to x.c at
float32 accuracy; float32 keys use tf32x3 for x.c. The one-hot sums are exact products (0/1 times
a key, or times each of a float32 key's three exact tf32 parts) accumulated in float32, so a
cluster of one point has that point as its centre, bit for bit, as in the reference.
The ip metric's augmented coordinate sqrt(phi - |x|^2) is computed per point in float32 and its
product with the centres' last coordinate is added outside the tensor-core product. Where a
step's time goes, the decisions' figures and the variants measured: docs/kernels/kmeans.md.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator

import torch
import triton
import triton.language as tl
from triton.runtime.errors import OutOfResources

from pqattn.reference import pq as ref
from pqattn.runtime.launch import Launcher, interpreted

# The tuning space: points per step, warps, pipeline depth of the point loads. Every config is
# exercised by the tests. `default_config` picks by sub-vector width: d >= 64 runs 8 warps,
# narrower sub-vectors 4 warps. float32 keys take twice the shared memory per stage (tf32x3
# operands): they run unpipelined, as three stages of [128, 64] float32 points exceed the 227 KB
# of an H100/H200 SM.
KMEANS_CONFIGS = [
    triton.Config({"BLOCK_N": bn}, num_warps=w, num_stages=3) for bn, w in ((128, 8), (128, 4), (64, 4))
]


def default_config(d: int) -> triton.Config:
    """The config for sub-vectors of d dimensions (see KMEANS_CONFIGS)."""
    return KMEANS_CONFIGS[0] if d >= 64 else KMEANS_CONFIGS[1]


# How many tokens one pass of the empty-cluster search reads.
RESEED_BLOCK = 1024
# The step kernel's fitted blocks, warps, stages and residency per specialisation (see _fit).
_FITTED: dict[tuple, tuple | None] = {}


@triton.jit
def _group(g, lengths_ptr, keys_ptr, Hkv, M, stride_kb, stride_kh, stride_kn, off, n, d):
    """Group g's first point (token `off`, sub-vector g % M of its (b, kv-head)) and its count of
    valid points (tokens off..lengths[b], at most n)."""
    i = g // M
    b = i // Hkv
    base = (
        keys_ptr
        + b.to(tl.int64) * stride_kb
        + (i % Hkv).to(tl.int64) * stride_kh
        + off.to(tl.int64) * stride_kn
        + (g % M) * d
    )
    nv = tl.minimum(tl.maximum(tl.load(lengths_ptr + b).to(tl.int32) - off, 0), n)
    return base, nv


@triton.jit(do_not_specialize=["off"])  # off may be 1
def _norms_kernel(
    keys_ptr,
    lengths_ptr,
    xx_ptr,  # [G, n] float32
    phi_bits_ptr,  # [G] int32 (ip), zeroed
    Hkv,
    M,
    stride_kb,
    stride_kh,
    stride_kn,
    off,
    n,
    d,
    IP: tl.constexpr,
    BD: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """Squared norms of every point (0 past a sequence's length), read by each Lloyd step instead
    of recomputing them from the tile, and for ip phi[g] = their maximum, as the bit pattern of a
    non-negative float32 (whose integer order is its float order) through atomic max. One block
    of tokens per program: the pass is a single read of the keys, spread over the whole GPU."""
    t = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    g = tl.program_id(1)
    base, nv = _group(g, lengths_ptr, keys_ptr, Hkv, M, stride_kb, stride_kh, stride_kn, off, n, d)
    dd = tl.arange(0, BD)
    x = tl.load(
        base + t[:, None].to(tl.int64) * stride_kn + dd[None, :],
        mask=(t[:, None] < nv) & (dd[None, :] < d),
        other=0.0,
    ).to(tl.float32)
    xx = tl.sum(x * x, axis=1)
    tl.store(xx_ptr + g.to(tl.int64) * n + t, xx, mask=t < n)
    if IP:
        tl.atomic_max(phi_bits_ptr + g, tl.max(xx, axis=0).to(tl.int32, bitcast=True))


@triton.jit
def _hash32(x):
    """`pqattn.reference.pq.hash32` on uint32 values (multiplication wraps modulo 2**32)."""
    x = x ^ (x >> 16)
    x = x * 0x21F0AAAD
    x = x ^ (x >> 15)
    x = x * 0x735A2D97
    return x ^ (x >> 15)


@triton.jit(do_not_specialize=["off", "seed_hash", "group_skip", "group_base"])
def _init_kernel(
    keys_ptr,
    lengths_ptr,
    seed_hash,  # hash32(seed mod 2**32)
    group_skip,  # (total_heads - Hkv) * M: the hashed group index skips other ranks' heads
    group_base,  # head_offset * M
    xx_ptr,  # [G, n] float32: squared norms
    phi_ptr,
    cent_ptr,
    aug_ptr,
    ctl_ptr,
    Hkv,
    M,
    stride_kb,
    stride_kh,
    stride_kn,
    off,
    n,
    C,
    d,
    G,
    IP: tl.constexpr,
    CP: tl.constexpr,
    BD: tl.constexpr,
):
    """Centres = the points `pqattn.reference.pq.init_positions` picks (zero for a group with no
    point), the loop's control reset."""
    g = tl.program_id(0)
    base, nv = _group(g, lengths_ptr, keys_ptr, Hkv, M, stride_kb, stride_kh, stride_kn, off, n, d)
    cc = tl.arange(0, CP)
    dd = tl.arange(0, BD)
    real = cc < tl.where(nv > 0, C, 0)  # (a scalar & block mask comes out int32 in Triton 3.9's interpreter)
    gid = g + g // (Hkv * M) * group_skip + group_base  # `pqattn.reference.pq.group_ids`
    h = _hash32(_hash32(seed_hash.to(tl.uint32) ^ gid.to(tl.uint32)) ^ cc.to(tl.uint32)).to(tl.int64)
    j = cc.to(tl.int64)
    nv64 = nv.to(tl.int64)
    lo = j * nv64 // C
    size = tl.maximum((j + 1) * nv64 // C - lo, 1)
    pick = tl.where(nv >= C, lo + h % size, j % tl.maximum(nv64, 1))
    pick = tl.where(real, pick, 0)
    rows = tl.load(
        base + pick[:, None] * stride_kn + dd[None, :], mask=real[:, None] & (dd[None, :] < d), other=0.0
    ).to(tl.float32)
    tl.store(cent_ptr + g.to(tl.int64) * CP * BD + cc[:, None] * BD + dd[None, :], rows)
    if IP:
        # |x|^2 from the norms pass, not re-summed here: phi - |x|^2 must come out exactly 0 for
        # the largest point (sqrt turns an ulp of phi there into an error of ~sqrt(ulp)).
        xx = tl.load(xx_ptr + g.to(tl.int64) * n + pick, mask=real, other=0.0)
        a = tl.sqrt(tl.maximum(tl.load(phi_ptr + g) - xx, 0.0))
        tl.store(aug_ptr + g * CP + cc, tl.where(real, a, 0.0))
    _reset_control(ctl_ptr, g, G)


@triton.jit
def _reset_control(ctl_ptr, g, G):
    tl.store(ctl_ptr + g, 0)  # the combine counter
    tl.store(ctl_ptr + G + g, 1)  # active
    tl.store(ctl_ptr + 2 * G + g, 1)  # centres changed since the last assignment
    tl.store(ctl_ptr + 3 * G + g, 0)  # iterations run


@triton.jit(do_not_specialize=["off", "it"])  # off may be 1; it changes every launch
def _lloyd_step_kernel(
    keys_ptr,
    lengths_ptr,  # [B] int64
    cent_ptr,  # [G, CP, BD] float32, zero padded
    aug_ptr,  # [G, CP] float32: the ip centres' augmented coordinate
    phi_ptr,  # [G] float32 (ip)
    code_ptr,  # [B, Hkv, N, M] uint8
    xx_ptr,  # [G, n] float32: squared norms
    dist_ptr,  # [G, n] float32
    part_ptr,  # [G, P, PART] float32
    ctl_ptr,  # [4, G] int32: combine counter, active, centres changed, iterations run
    hist_ptr,  # [iters + 1, G] float32 objective
    Hkv,
    M,
    stride_kb,
    stride_kh,
    stride_kn,
    stride_cb,
    stride_ch,
    stride_cn,
    off,
    n,
    chunk,
    C,
    d,
    G,
    it,
    tol,
    UPDATE: tl.constexpr,  # False: the last launch, which writes the codes
    IP: tl.constexpr,
    SPLITS: tl.constexpr,  # 0: float32 keys, tf32x3 products; 2 or 3: centre parts in the keys' dtype
    UPCAST: tl.constexpr,  # run the split products in float32 (the interpreter's bf16 tl.dot is wrong)
    CP: tl.constexpr,
    BD: tl.constexpr,
    BLOCK_N: tl.constexpr,
    RB: tl.constexpr,
    FOLD: tl.constexpr,  # d + 4 <= BD: counts and ip sums in the point tile's padding columns
):
    EXT: tl.constexpr = 16
    p = tl.program_id(0)
    n_prog = tl.num_programs(0)
    g = tl.program_id(1)
    cc = tl.arange(0, CP)
    dd = tl.arange(0, BD)
    if UPDATE and tl.load(ctl_ptr + 2 * G + g) == 0:
        # Stopped before the last update: same centres, same assignment, same objective.
        if p == 0:
            tl.store(hist_ptr + it * G + g, tl.load(hist_ptr + (it - 1) * G + g))
    else:
        x_base, nv = _group(g, lengths_ptr, keys_ptr, Hkv, M, stride_kb, stride_kh, stride_kn, off, n, d)
        cent = tl.load(cent_ptr + g.to(tl.int64) * CP * BD + cc[:, None] * BD + dd[None, :])
        c_norm = tl.sum(cent * cent, axis=1)
        phi = 0.0
        c_aug = tl.zeros([CP], dtype=tl.float32)
        if IP:
            phi = tl.load(phi_ptr + g)
            c_aug = tl.load(aug_ptr + g * CP + cc)
            c_norm += c_aug * c_aug
        c_norm = tl.where(cc < C, c_norm, float("inf"))  # padding never wins
        dt = keys_ptr.dtype.element_ty
        if SPLITS == 0:
            c1 = cent
            c2 = cent
            c3 = cent
        else:
            c1 = cent.to(dt)
            r = cent - c1.to(tl.float32)
            c2 = r.to(dt)
            c3 = (r - c2.to(tl.float32)).to(dt)
            if UPCAST:
                dt = tl.float32
                c1 = c1.to(dt)
                c2 = c2.to(dt)
                c3 = c3.to(dt)
        sums = tl.zeros([CP, BD], dtype=tl.float32)
        # Per-centre counts and ip coordinate sums come out of a tensor-core product too, the
        # one-hot matrix's with the columns [1, a1, a2, a3] (a split into parts of the product's
        # dtype, exact in float32 accumulation) instead of reductions over the tile. FOLD: they
        # are the point tile's zero padding columns d..d+3, so the centre sums' product yields
        # them; else a product with EXT more columns.
        ext = tl.zeros([CP, EXT], dtype=tl.float32)
        col = tl.arange(0, EXT)
        obj = tl.zeros([BLOCK_N], dtype=tl.float32)
        lo = p * chunk
        hi = tl.minimum(lo + chunk, nv)
        # Padding tokens are never read: a cache past a sequence's length may hold NaN, and
        # 0 * NaN in the one-hot product would poison the sums. (The loads are pipelined by the
        # compiler, num_stages deep, through shared memory: a register prefetch cost occupancy.)
        for start in range(lo, tl.minimum(lo + chunk, n), BLOCK_N):
            t = start + tl.arange(0, BLOCK_N)
            valid = t < nv
            x = tl.load(
                x_base + t[:, None].to(tl.int64) * stride_kn + dd[None, :],
                mask=(t[:, None] < hi) & (dd[None, :] < d),
                other=0.0,
            )
            xx = tl.load(xx_ptr + g.to(tl.int64) * n + t, mask=valid, other=0.0)
            if SPLITS == 0:
                xc = tl.dot(x, tl.trans(c1), input_precision="tf32x3")
            else:
                x = x.to(dt)
                xc = tl.dot(x, tl.trans(c1))
                xc = tl.dot(x, tl.trans(c2), xc)
                if SPLITS == 3:
                    xc = tl.dot(x, tl.trans(c3), xc)
            a = tl.zeros([BLOCK_N], dtype=tl.float32)
            if IP:
                a = tl.sqrt(tl.maximum(phi - xx, 0.0))
                xc += a[:, None] * c_aug[None, :]
                xx += a * a
            score = c_norm[None, :] - 2.0 * xc  # [BLOCK_N, CP]
            nearest, best = tl.min(score, axis=1, return_indices=True)
            dist = tl.where(valid, tl.maximum(xx + nearest, 0.0), 0.0)
            tl.store(dist_ptr + g.to(tl.int64) * n + t, dist, mask=t < n)
            obj += dist
            if UPDATE:
                onehot = tl.where((best[:, None] == cc[None, :]) & valid[:, None], 1.0, 0.0)
                if FOLD:
                    x = tl.where(dd[None, :] < d, x, _extra_columns(a, dd - d, IP, SPLITS, dt))
                if SPLITS == 0:
                    # Three tf32 parts, each product exact: tf32x3 rounds the key's second part
                    # to tf32, so a cluster of one point came out an ulp off that point, unequal to
                    # a reseed to it (the reference's two equal centres, a tie to the lower index).
                    onehot = tl.trans(onehot)
                    x1, x2, x3 = _tf32_parts(x)
                    sums = tl.dot(onehot, x1, sums, input_precision="tf32")
                    sums = tl.dot(onehot, x2, sums, input_precision="tf32")
                    sums = tl.dot(onehot, x3, sums, input_precision="tf32")
                    if not FOLD:
                        e = _extra_columns(a, col, IP, SPLITS, dt)
                        ext = tl.dot(onehot, e, ext, input_precision="tf32")
                else:
                    onehot = tl.trans(onehot.to(dt))
                    sums = tl.dot(onehot, x, sums)
                    if not FOLD:
                        ext = tl.dot(onehot, _extra_columns(a, col, IP, SPLITS, dt), ext)
            else:
                code_at = (
                    code_ptr
                    + (g // M // Hkv).to(tl.int64) * stride_cb
                    + (g // M % Hkv).to(tl.int64) * stride_ch
                )
                code_at += (off + t).to(tl.int64) * stride_cn + g % M
                tl.store(code_at, tl.where(valid, best, 0).to(tl.uint8), mask=t < n)
        # The partial: [sums (CP x BD) | counts (CP) | ip sums (CP) | objective]; the last launch
        # (codes) needs the objective only.
        PART: tl.constexpr = CP * BD + 2 * CP + 1
        part = part_ptr + (g.to(tl.int64) * n_prog + p) * PART
        tl.store(part + CP * BD + 2 * CP, tl.sum(obj, axis=0))
        if UPDATE:
            tl.store(part + cc[:, None] * BD + dd[None, :], sums)
            if FOLD:
                counts = tl.sum(tl.where(dd[None, :] == d, sums, 0.0), axis=1)
                augs = tl.sum(tl.where(dd[None, :] > d, sums, 0.0), axis=1)
            else:
                counts = tl.sum(tl.where(col[None, :] == 0, ext, 0.0), axis=1)
                augs = tl.sum(tl.where(col[None, :] > 0, ext, 0.0), axis=1)
            tl.store(part + CP * BD + cc, counts)
            tl.store(part + CP * BD + CP + cc, augs)
        tl.debug_barrier()  # every thread's partial and distance stores precede the release
        arrived = tl.atomic_add(ctl_ptr + g, 1, sem="acq_rel")
        if arrived == n_prog - 1:  # the group's last program combines and updates
            tl.atomic_xchg(ctl_ptr + g, 0)  # ready for the next launch
            sums = tl.zeros([CP, BD], dtype=tl.float32)
            counts = tl.zeros([CP], dtype=tl.float32)
            augs = tl.zeros([CP], dtype=tl.float32)
            total = 0.0
            for q in range(0, n_prog):
                pq = part_ptr + (g.to(tl.int64) * n_prog + q) * PART
                total += tl.load(pq + CP * BD + 2 * CP, cache_modifier=".cg")
                if UPDATE:
                    sums += tl.load(pq + cc[:, None] * BD + dd[None, :], cache_modifier=".cg")
                    counts += tl.load(pq + CP * BD + cc, cache_modifier=".cg")
                    augs += tl.load(pq + CP * BD + CP + cc, cache_modifier=".cg")
            tl.store(hist_ptr + it * G + g, total)
            if UPDATE:
                if tl.load(ctl_ptr + G + g) != 0:  # active: apply the update
                    inv = 1.0 / tl.maximum(counts, 1.0)
                    new_c = tl.where(dd[None, :] < d, sums * inv[:, None], 0.0)  # (FOLD's columns)
                    new_aug = augs * inv
                    empty = (counts == 0) & (cc < tl.where(nv > 0, C, 0))
                    n_empty = tl.sum(empty.to(tl.int32), axis=0)
                    if n_empty > 0:
                        new_c, new_aug = _reseed_empty(
                            new_c, new_aug, empty, n_empty, x_base, dist_ptr + g.to(tl.int64) * n,
                            xx_ptr + g.to(tl.int64) * n, stride_kn, nv, C, d, phi, IP, BD, RB,
                        )  # fmt: skip
                    old = tl.load(cent_ptr + g.to(tl.int64) * CP * BD + cc[:, None] * BD + dd[None, :])
                    shift = tl.sum(tl.sum((new_c - old) * (new_c - old), axis=1), axis=0)
                    tl.store(cent_ptr + g.to(tl.int64) * CP * BD + cc[:, None] * BD + dd[None, :], new_c)
                    if IP:
                        shift += tl.sum((new_aug - c_aug) * (new_aug - c_aug), axis=0)
                        tl.store(aug_ptr + g * CP + cc, new_aug)
                    tl.store(ctl_ptr + G + g, (shift >= tol).to(tl.int32))
                    tl.store(ctl_ptr + 3 * G + g, tl.load(ctl_ptr + 3 * G + g) + 1)
                else:
                    tl.store(ctl_ptr + 2 * G + g, 0)


@triton.jit
def _extra_columns(a, col, IP: tl.constexpr, SPLITS: tl.constexpr, dt: tl.constexpr):
    """[BLOCK_N, len(col)] in the product's dtype: 1 at col == 0, the ip coordinate a's parts at
    col 1..3 (in tf32, or in dt), 0 elsewhere."""
    e = tl.broadcast_to(tl.where(col[None, :] == 0, 1.0, 0.0), (a.shape[0], col.shape[0]))
    if IP:
        if SPLITS == 0:
            a1, a2, a3 = _tf32_parts(a)
            e = tl.where(col[None, :] == 1, a1[:, None], e)
            e = tl.where(col[None, :] == 2, a2[:, None], e)
            e = tl.where(col[None, :] == 3, a3[:, None], e)
        else:
            a1 = a.to(dt)
            a_rest = a - a1.to(tl.float32)
            a2 = a_rest.to(dt)
            a3 = (a_rest - a2.to(tl.float32)).to(dt)
            e = tl.where(col[None, :] == 1, a1.to(tl.float32)[:, None], e)
            e = tl.where(col[None, :] == 2, a2.to(tl.float32)[:, None], e)
            e = tl.where(col[None, :] == 3, a3.to(tl.float32)[:, None], e)
    return e.to(dt)


@triton.jit
def _tf32_parts(x):
    """(p1, p2, p3) with p1 + p2 + p3 == x exactly and each part exact in tf32 (its low 13
    mantissa bits zero): p1 the top 11 significant bits, p2 the next 11, p3 the last 2."""
    p1 = (x.to(tl.int32, bitcast=True) & -8192).to(tl.float32, bitcast=True)
    r = x - p1
    p2 = (r.to(tl.int32, bitcast=True) & -8192).to(tl.float32, bitcast=True)
    return p1, p2, r - p2


@triton.jit
def _reseed_empty(
    new_c, new_aug, empty, n_empty, x_base, dist_row, xx_row, stride_kn, nv, C, d, phi,
    IP: tl.constexpr, BD: tl.constexpr, RB: tl.constexpr,
):  # fmt: skip
    """The reference's rule: the e-th empty cluster (in index order) takes the (e mod min(nv, C))-th
    farthest point from its centre. The j-th farthest is found by the j-th pass over the distances,
    taking the largest below the previous pick in (distance, -index) order (ties: lowest index)."""
    rank = tl.cumsum(empty.to(tl.int32), axis=0) - 1
    span = tl.minimum(nv, C)
    prev_d = float("inf")
    prev_i = -1
    dd = tl.arange(0, BD)
    for j in range(0, tl.minimum(n_empty, span)):
        best_d = -1.0
        best_i = nv
        for s in range(0, nv, RB):
            t = s + tl.arange(0, RB)
            dv = tl.load(dist_row + t, mask=t < nv, other=-1.0, cache_modifier=".cg")
            below = (dv < prev_d) | ((dv == prev_d) & (t > prev_i))
            dv = tl.where((t < nv) & below, dv, -1.0)
            m = tl.max(dv, axis=0)
            ti = tl.min(tl.where(dv == m, t, nv), axis=0)
            take = (m > best_d) | ((m == best_d) & (ti < best_i))
            best_d = tl.where(take, m, best_d)
            best_i = tl.where(take, ti, best_i)
        prev_d = best_d
        prev_i = best_i
        row = tl.load(x_base + best_i.to(tl.int64) * stride_kn + dd, mask=dd < d, other=0.0).to(tl.float32)
        to_seed = empty & (rank % span == j)
        new_c = tl.where(to_seed[:, None], row[None, :], new_c)
        if IP:
            new_aug = tl.where(to_seed, tl.sqrt(tl.maximum(phi - tl.load(xx_row + best_i), 0.0)), new_aug)
    return new_c, new_aug


_lloyd_step_launch = Launcher(_lloyd_step_kernel)


def _point_blocks(cap: int, CP: int, BD: int, warps: int) -> tuple[int, int]:
    """Points per step of the update launches and of the last (codes) launch, at most `cap`.

    A program holds the [block, CP] distances in registers, and in the update launches the
    [CP, BD] centre sums too: at C = 256 a fixed 128-point step spills. The update launches take
    the larger of 8192 / CP points and what fits 5120 elements a warp of both tiles, the last
    launch 16384 / CP (docs/kernels/kmeans.md).
    """
    fits = max(1, (5120 * warps - CP * BD) // CP)
    block = min(cap, max(16, 8192 // CP, 1 << (fits.bit_length() - 1)))
    return block, max(block, min(cap, max(16, 16384 // CP)))


def _splits(dtype: torch.dtype) -> int:
    return {torch.float32: 0, torch.bfloat16: 3, torch.float16: 2}[dtype]


def _compiled(args: tuple, meta: dict):
    """The step kernel compiled for these arguments, or None when it needs more shared memory
    than the device has (Triton raises that at the first launch; the build must know before)."""
    k = _lloyd_step_kernel.warmup(*args, 0, 0.0, grid=(1,), **meta)
    try:
        k._init_handles()
    except OutOfResources:
        return None
    return k


def _step_downs(config: triton.Config, CP: int, BD: int, stages: int) -> Iterator[tuple[int, int, int, int]]:
    """(point block, last launch's block, warps, stages) in _fit's order of trial."""
    for warps in (config.num_warps, 4 if config.num_warps == 8 else 8):
        block, last = _point_blocks(config.kwargs["BLOCK_N"], CP, BD, warps)
        yield block, last, warps, stages
        yield block, last, warps, 1
        while block > 16 or last > 16:
            block, last = max(16, block // 2), max(16, last // 2)
            yield block, last, warps, 1


def _fit(
    args: tuple, meta: dict, config: triton.Config, CP: int, BD: int, dev: torch.device
) -> tuple[int, int, int, int, int] | None:
    """(point block, last launch's block, warps, stages, programs an SM holds) for `config`.

    On a GPU the config's own values are taken when both step kernels fit the device's shared
    memory; else the first that fits of: one stage, then halved blocks (to 16 points), then the
    other warp count. None when none fits, which build_pq routes to the reference (on an H100 or
    H200: float32 keys with d = 128, C = 256 or d = 256, C >= 128; 16-bit keys with d = 256, C = 256).
    """
    warps, stages = config.num_warps, meta["num_stages"]
    if dev.type != "cuda":
        return (*_point_blocks(config.kwargs["BLOCK_N"], CP, BD, warps), warps, stages, 1)
    key = (dev.index, str(args[0].dtype), tuple(sorted(meta.items())), str(config))
    if key not in _FITTED:
        _FITTED[key] = None
        props = torch.cuda.get_device_properties(dev)
        for block, last, w, st in dict.fromkeys(_step_downs(config, CP, BD, stages)):
            m = {**meta, "num_warps": w, "num_stages": st}
            k = _compiled(args, {**m, "UPDATE": True, "BLOCK_N": block})
            if k is None or _compiled(args, {**m, "UPDATE": False, "BLOCK_N": last}) is None:
                continue
            regs = 65536 // (-(-k.n_regs // 8) * 8 * 32 * w)
            smem = getattr(props, "shared_memory_per_multiprocessor", 233472) // (k.metadata.shared + 1024)
            _FITTED[key] = (block, last, w, st, max(1, min(regs, smem)))
            break
    return _FITTED[key]


def _reference_build(keys: torch.Tensor, lengths: torch.Tensor, iters: int, **kw) -> ref.KMeansResult:
    """The reference build on the keys' device, in build_pq's output contract (iters + 1 rounds
    of the objective, the iteration count as a device tensor). Tokens past a sequence's length
    are zeroed first: the reference multiplies them by 0, and the cache may hold NaN there."""
    past = torch.arange(keys.shape[2], device=keys.device)[None, :] >= lengths[:, None]
    keys = keys.masked_fill(past[:, None, :, None], 0.0)
    book = ref.build_pq(keys, lengths, iters=iters, **kw)
    objective = book.objective.float()
    pad = objective[-1:].expand(iters + 1 - objective.shape[0], *objective.shape[1:])
    return ref.KMeansResult(
        centroids=book.centroids.float(),
        codes=book.codes,
        phi=None if book.phi is None else book.phi.float(),
        objective=torch.cat([objective, pad]),
        iterations=torch.tensor(book.iterations, device=keys.device),
    )


def _step_meta(keys: torch.Tensor, ip: bool, CP: int, BD: int, d: int, config: triton.Config) -> dict:
    """The step kernel's compile-time arguments for these keys (blocks and warps come from _fit)."""
    return dict(
        IP=ip, SPLITS=_splits(keys.dtype), UPCAST=interpreted() and keys.dtype == torch.bfloat16,
        CP=CP, BD=BD, RB=RESEED_BLOCK, FOLD=d + 4 <= BD,
        num_stages=config.num_stages if keys.element_size() < 4 else 1,
    )  # fmt: skip


def _programs(dev: torch.device, resident: int, G: int, n: int, last_block: int) -> tuple[int, int]:
    """(P, chunk): programs per group and tokens per program. One wave at the compiled occupancy,
    at least one program per group and at most one per 512 tokens (the last program reads every
    partial: more programs make its combine longer); chunk is a multiple of both point blocks.
    The interpreter runs up to two, so that the tests exercise the combine."""
    if dev.type == "cuda":
        P = resident * torch.cuda.get_device_properties(dev).multi_processor_count // G
        P = max(1, min(P, triton.cdiv(n, 512)))
    else:
        P = max(1, min(2, triton.cdiv(n, 512)))
    return P, triton.cdiv(triton.cdiv(n, P), last_block) * last_block


def _part_numel(CP: int, BD: int) -> int:
    """A program's partial: [sums (CP x BD) | counts (CP) | ip sums (CP) | objective]."""
    return CP * BD + 2 * CP + 1


def _prepared(
    keys: torch.Tensor, lengths: torch.Tensor, M: int, C: int, d: int, config: triton.Config | None
) -> tuple[torch.Tensor, torch.Tensor, int, int, triton.Config, tuple]:
    """(keys with a contiguous last dim, lengths int64 on their device, CP, BD, config, the step
    kernel's geometry arguments) for M groups a KV head of C centres over d dimensions."""
    if keys.stride(-1) != 1:
        keys = keys.contiguous()
    lengths = lengths.to(device=keys.device, dtype=torch.int64)
    geometry = (keys.shape[1], M, keys.stride(0), keys.stride(1), keys.stride(2))
    CP, BD = max(C, 16), max(16, triton.next_power_of_2(d))
    return keys, lengths, CP, BD, config or default_config(d), geometry


def build_pq(
    keys: torch.Tensor,
    lengths: torch.Tensor,
    *,
    subvectors: int,
    bits: int,
    metric: str = "euclidean",
    init_offset: int = 0,
    iters: int = 10,
    tol: float = 1e-4,
    seed: int = 0,
    init: torch.Tensor | None = None,
    head_offset: int = 0,
    total_heads: int | None = None,
    config: triton.Config | None = None,
) -> ref.KMeansResult:
    """`pqattn.reference.pq.build_pq` with the Lloyd loop in Triton: same arguments, init, rules
    and outputs (keys fp16/bf16/fp32 [B, Hkv, N, D], last dim contiguous; lengths [B] int64 on
    keys' device). No host sync and no host-to-device copy: the init kernel draws the centres
    from `seed` itself, the iteration count comes back as a device tensor and the objective with
    all iters + 1 rows, so a build with a fixed shape can be captured in a CUDA graph. A build
    with no token to quantize is the reference's (nothing to run). `config` forces one of
    KMEANS_CONFIGS.
    """
    B, Hkv, N, D = keys.shape
    M, C = subvectors, 1 << bits
    d, n, G = D // M, max(N - init_offset, 0), B * Hkv * M
    heads = dict(head_offset=head_offset, total_heads=total_heads)
    if n == 0 or G == 0:
        return ref.build_pq(
            keys, lengths, subvectors=M, bits=bits, metric=metric, init_offset=init_offset,
            iters=iters, tol=tol, seed=seed, init=init, **heads,
        )  # fmt: skip
    keys, lengths, CP, BD, config, geometry = _prepared(keys, lengths, M, C, d, config)
    dev, ip = keys.device, metric == "ip"

    f32 = dict(dtype=torch.float32, device=dev)
    cent = torch.empty(G, CP, BD, **f32)
    aug = torch.zeros(G, CP, **f32)
    phi = torch.zeros(G, **f32)
    ctl = torch.empty(4, G, dtype=torch.int32, device=dev)
    codes = torch.zeros(B, Hkv, N, M, dtype=torch.uint8, device=dev)
    xx = torch.empty(G, n, **f32)
    dist = torch.empty(G, n, **f32)
    hist = torch.empty(iters + 1, G, **f32)
    meta = _step_meta(keys, ip, CP, BD, d, config)
    strides = (codes.stride(0), codes.stride(1), codes.stride(2), init_offset, n)
    # (the fit compiles with stand-ins for the partials and the chunk: same specialisation)
    stand_in = (keys, lengths, cent, aug, phi, codes, xx, dist, dist, ctl, hist, *geometry, *strides, 16)
    fit = _fit((*stand_in, C, d, G), meta, config, CP, BD, dev)
    if fit is None:
        warnings.warn(
            f"build_pq: the Triton step's tiles for sub-vectors of {d} dimensions and {C} centres "
            "exceed this GPU's shared memory; building with the PyTorch reference instead (slower)",
            stacklevel=2,
        )
        return _reference_build(
            keys, lengths, iters, subvectors=M, bits=bits, metric=metric, init_offset=init_offset,
            tol=tol, seed=seed, init=init, **heads,
        )  # fmt: skip
    block, last_block, warps, stages, resident = fit
    meta.update(BLOCK_N=block, num_warps=warps, num_stages=stages)
    P, chunk = _programs(dev, resident, G, n, last_block)
    parts = torch.empty(G, P, _part_numel(CP, BD), **f32)
    tensors = (keys, lengths, cent, aug, phi, codes, xx, dist, parts, ctl, hist)
    args = (*tensors, *geometry, *strides, chunk, C, d, G)

    norms_block = max(16, 8192 // BD)
    _norms_kernel[(triton.cdiv(n, norms_block), G)](
        keys, lengths, xx, phi.view(torch.int32), *geometry, init_offset, n, d,
        IP=ip, BD=BD, BLOCK_N=norms_block,
    )  # fmt: skip
    if init is None:
        seed_hash = ref.hash32(seed & ref.HASH_MASK)
        skip = ((Hkv if total_heads is None else total_heads) - Hkv) * M
        _init_kernel[(G,)](
            keys, lengths, seed_hash, skip, head_offset * M, xx, phi, cent, aug, ctl, *geometry,
            init_offset, n, C, d, G,
            IP=ip, CP=CP, BD=BD,
        )  # fmt: skip
    else:
        c0 = init.reshape(G, C, -1).float()
        cent.zero_()[:, :C, :d] = c0[..., :d]
        if ip:
            aug[:, :C] = c0[..., d]
        ctl.zero_()
        ctl[1:3].fill_(1)  # active, centres changed
    # The Launcher relaunches the compiled kernel: Triton's dispatch would dominate the host time.
    for it in range(iters):
        _lloyd_step_launch((P, G), tensors, (*args[len(tensors) :], it, tol), {"UPDATE": True, **meta})
    _lloyd_step_kernel[(P, G)](*args, iters, tol, UPDATE=False, **{**meta, "BLOCK_N": last_block})
    centroids = cent[:, :C, :d]
    if ip:
        centroids = torch.cat([centroids, aug[:, :C, None]], dim=-1)
    return ref.KMeansResult(
        centroids=centroids.reshape(B, Hkv, M, C, -1),
        codes=codes,
        phi=phi.reshape(B, Hkv, M) if ip else None,
        objective=hist.reshape(-1, B, Hkv, M),
        iterations=ctl[3].amax(),
    )


def encode_keys(
    keys: torch.Tensor,
    lengths: torch.Tensor,
    centroids: torch.Tensor,
    codes: torch.Tensor,
    *,
    init_offset: int = 0,
    config: triton.Config | None = None,
) -> bool:
    """Every key's code against a euclidean build's centroids, as a build's last launch writes
    them: keys fp16/bf16/fp32 [B, Hkv, N, D], lengths [B] on keys' device, centroids [B, Hkv, M,
    C, D // M] float32, codes [B, Hkv, N, M] uint8 (last dim contiguous), rows init_offset.. N
    written (0 past each length), the rows before left as they are. One launch of the step
    kernel's codes pass (tensor-core distances over tiles of points, one wave of programs), then
    no host sync: the bulk encode of a build on a sample, where the per-token encode kernel
    re-reads every centroid for each key. False, with nothing written, where no config's tiles
    fit the GPU's shared memory (the caller encodes another way).
    """
    B, Hkv, N = keys.shape[:3]
    M, C, d = centroids.shape[2], centroids.shape[3], centroids.shape[4]
    if codes.shape != (B, Hkv, N, M) or codes.dtype != torch.uint8 or codes.stride(-1) != 1:
        raise ValueError(
            f"codes: expected uint8 {(B, Hkv, N, M)} with a contiguous last dim, got {codes.dtype} "
            f"{tuple(codes.shape)} strides {codes.stride()}"
        )
    n, G = max(N - init_offset, 0), B * Hkv * M
    if n == 0 or G == 0:
        return True
    keys, lengths, CP, BD, config, geometry = _prepared(keys, lengths, M, C, d, config)
    dev = keys.device
    f32 = dict(dtype=torch.float32, device=dev)
    cent = torch.zeros(G, CP, BD, **f32)
    cent[:, :C, :d] = centroids.reshape(G, C, d)
    no_ip = torch.zeros(G, CP, **f32)  # the augmented coordinate and phi: unused (euclidean)
    ctl = torch.zeros(4, G, dtype=torch.int32, device=dev)  # the arrival counters
    xx = torch.empty(G, n, **f32)
    dist = torch.empty(G, n, **f32)
    objective = torch.empty(1, G, **f32)
    meta = _step_meta(keys, False, CP, BD, d, config)
    strides = (codes.stride(0), codes.stride(1), codes.stride(2), init_offset, n)
    stand_in = (keys, lengths, cent, no_ip, no_ip, codes, xx, dist, dist, ctl, objective)
    fit = _fit((*stand_in, *geometry, *strides, 16, C, d, G), meta, config, CP, BD, dev)
    if fit is None:
        return False
    _, last_block, warps, stages, resident = fit
    P, chunk = _programs(dev, resident, G, n, last_block)
    parts = torch.empty(G, P, _part_numel(CP, BD), **f32)
    norms_block = max(16, 8192 // BD)
    _norms_kernel[(triton.cdiv(n, norms_block), G)](
        keys, lengths, xx, no_ip, *geometry, init_offset, n, d, IP=False, BD=BD, BLOCK_N=norms_block
    )
    _lloyd_step_kernel[(P, G)](
        keys, lengths, cent, no_ip, no_ip, codes, xx, dist, parts, ctl, objective, *geometry, *strides,
        chunk, C, d, G, 0, 0.0,
        UPDATE=False, **{**meta, "BLOCK_N": last_block, "num_warps": warps, "num_stages": stages},
    )  # fmt: skip
    return True
