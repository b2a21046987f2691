"""PQ encoding of appended keys (SPEC §1, append): the nearest centroid per sub-vector.

One program per (sequence, KV head, new token, sub-vector), so that an append is one round of
loads whatever M is (a histogram, which needs a token's whole combination, takes one program per
token over its M sub-vectors). Distances are ||c||^2 - 2 <x, c> (the ||x||^2 term does not change
the argmin); for the ip metric x is augmented with sqrt(phi - ||x||^2)
first. The code is written straight into the caller's code buffer, at row `base[b] + t` when a
base (the sequence lengths) is given, so an append is one launch.

With a histogram (PQIndex, histogram selection) the same launch keeps the combination counts of
the candidate tokens [cand_lo, n - window) current. Writing T tokens at row0 over n_drop tokens
that were there (a caller that rewinds, as the original's entry point may: n_drop <= window, so
none of them was a candidate yet) moves the candidates' end from e_old = row0 + n_drop - window
to e_new = row0 + T - window. Program t adds its own token when that one is already past the
window (t < T - window); the positions of [e_old, e_new) below row0, or of [e_new, e_old) when
the end moves back, are stored codes no program of the launch writes: program t adds (removes)
the t-th of them. With n_drop = 0 (PQIndex's appends) that is: T tokens appended to n_old make
[n_old - window, n_old + T - window) candidates.

A decode step fuses more into the launch, so that it is one node instead of four: the new key
and value rows are stored into the caller's KV cache at row base[b] + t (cast to the cache's
dtype), and the last program of a sequence to finish advances base[b] by T (an arrival counter
per sequence: every program of the sequence has read base[b] before it arrives), to
base[b] + row0 + T: row0 = -n_drop for a caller that rewrites its last n_drop rows.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pqattn.kernels.codes import candidacy_changes, nearest_code
from pqattn.kernels.pdl import pdl_meta, release_next
from pqattn.runtime.launch import Launcher


@triton.jit
def _pq_encode_kernel(
    k_ptr,
    cent_ptr,
    phi_ptr,
    base_ptr,
    out_ptr,
    hist_ptr,
    kc_ptr,
    vc_ptr,
    vn_ptr,
    arrive_ptr,
    stride_kb,
    stride_kk,
    stride_kt,
    stride_kd,
    stride_cb,
    stride_ck,
    stride_cm,
    stride_cc,
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
    stride_vnt,
    stride_vnd,
    Hkv,
    T,
    G,
    row0,
    n_drop,
    window,
    cand_lo,
    M: tl.constexpr,
    M_PER: tl.constexpr,
    C: tl.constexpr,
    DSUB: tl.constexpr,
    BLOCK_D: tl.constexpr,
    IP: tl.constexpr,
    HAS_BASE: tl.constexpr,
    HAS_HIST: tl.constexpr,
    P: tl.constexpr,
    STORE_KV: tl.constexpr,
    ADVANCE: tl.constexpr,
    KEY_AT_BASE: tl.constexpr,  # the key is row base[b] + t of k (a cache the caller wrote first)
    PDL: tl.constexpr,
):
    release_next(PDL)  # a selection launched behind this one may start (pqattn.kernels.pdl)
    SPLITS: tl.constexpr = M // M_PER
    pid = tl.program_id(0)
    part = pid % SPLITS  # this program's M_PER sub-vectors start at part * M_PER
    t = (pid // SPLITS) % G
    kvh = (pid // (SPLITS * G)) % Hkv
    b = pid // (SPLITS * G * Hkv)
    new = t < T
    cent = cent_ptr + b * stride_cb + kvh * stride_ck
    first = row0
    if HAS_BASE:
        first += tl.load(base_ptr + b).to(tl.int32)
    row = first + t
    key = k_ptr + b.to(tl.int64) * stride_kb + kvh * stride_kk + (row if KEY_AT_BASE else t) * stride_kt
    out = out_ptr + b * stride_ob + kvh * stride_ok + row * stride_on
    combo = 0
    for i in tl.static_range(M_PER):
        m = part * M_PER + i
        code = nearest_code(
            key + m * DSUB * stride_kd,
            stride_kd,
            new,
            cent + m * stride_cm,
            stride_cc,
            phi_ptr + (b * Hkv + kvh) * M + m,
            C,
            DSUB,
            BLOCK_D,
            IP,
        )
        tl.store(out + m * stride_om, code.to(out_ptr.dtype.element_ty), mask=new)
        combo = combo * C + code
    if HAS_HIST:  # M_PER == M: this program holds the token's whole combination
        hist = hist_ptr + (b * Hkv + kvh).to(tl.int64) * P
        codes_row = out_ptr + b * stride_ob + kvh * stride_ok
        own, old_combo, old_change = candidacy_changes(
            codes_row, stride_on, stride_om, new, t, T, first, n_drop, window, cand_lo, M, C
        )
        if own:
            tl.atomic_add(hist + combo, 1, sem="relaxed")
        if old_change != 0:
            tl.atomic_add(hist + old_combo, old_change, sem="relaxed")
    if STORE_KV:  # this program's share of the row: the elements of its sub-vectors
        d_idx = tl.arange(0, BLOCK_D)
        b64 = b.to(tl.int64)  # a KV cache can pass 2**31 elements
        k_dst = kc_ptr + b64 * stride_kcb + kvh * stride_kck + row.to(tl.int64) * stride_kcn
        v_dst = vc_ptr + b64 * stride_vcb + kvh * stride_vck + row.to(tl.int64) * stride_vcn
        v_src = vn_ptr + b * stride_vnb + kvh * stride_vnk + t * stride_vnt
        for d0 in tl.static_range(0, M_PER * DSUB, BLOCK_D):
            d = part * (M_PER * DSUB) + d0 + d_idx
            tl.store(k_dst + d * stride_kcd, tl.load(key + d * stride_kd).to(kc_ptr.dtype.element_ty))
            tl.store(v_dst + d * stride_vcd, tl.load(v_src + d * stride_vnd).to(vc_ptr.dtype.element_ty))
    if ADVANCE:
        # every warp has read base[b] and stored its elements before the release below: a warp
        # that read it after the last arrival advanced it would write at the next row
        tl.debug_barrier()
        arrived = tl.atomic_add(arrive_ptr + b, 1, sem="acq_rel")
        if arrived == Hkv * G * SPLITS - 1:
            tl.store(base_ptr + b, (first + T).to(base_ptr.dtype.element_ty))
            tl.store(arrive_ptr + b, 0)


_pq_encode_launch = Launcher(_pq_encode_kernel)


def pq_encode(
    keys: torch.Tensor,
    centroids: torch.Tensor,
    phi: torch.Tensor | None,
    out: torch.Tensor,
    base: torch.Tensor | None = None,
    hist: torch.Tensor | None = None,
    window: int = 0,
    cand_lo: int = 0,
    kv_cache: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    advance: torch.Tensor | None = None,
    *,
    row0: int = 0,
    n_drop: int = 0,
    key_at_base: bool = False,
) -> None:
    """Write codes of keys [B, Hkv, T, D] into out (indexed [b, kvh, row, m] by its strides).

    centroids [B, Hkv, M, C, dsub(+1)] (last dim contiguous); phi [B, Hkv, M] contiguous for ip;
    row = base[b] + row0 + t when base [B] is given, else row0 + t. hist [B, Hkv, C**M] int32
    (contiguous): the candidate counts of pqattn.kernels.select.hist for sequences that ended at
    base + row0 + n_drop, brought to base + row0 + T (see the module's docstring; n_drop <=
    window). kv_cache (with base, n_drop 0): (k_cache, v_cache, values), the caches
    [B, Hkv, >= base + T, D] receive keys and values [B, Hkv, T, D] at rows base[b] + t.
    advance (with base): int32 [B] arrival counters, zero-filled once (left at zero): base is
    set to base + row0 + T in the same launch. key_at_base (with base, row0 = n_drop = 0): one
    key per sequence, row base[b] of keys [B, Hkv, >= base + 1, D] (a cache the caller wrote
    first). Validated inputs only.
    """
    B, Hkv, T, D = keys.shape
    if key_at_base:
        if base is None or row0 or n_drop:
            raise ValueError("key_at_base: the key is row base[b] of keys; expected base, row0 = n_drop = 0")
        T = 1
    M, C, width = centroids.shape[2], centroids.shape[3], centroids.shape[4]
    dsub = D // M
    ip = width == dsub + 1
    if not 0 <= n_drop <= window:
        raise ValueError(f"n_drop: expected 0 <= n_drop <= window={window}, got {n_drop}")
    if (kv_cache is not None or advance is not None) and base is None:
        raise ValueError("base: kv_cache and advance write at base[b] + t; expected base, got None")
    if kv_cache is not None and (n_drop or row0):
        raise ValueError("kv_cache: the rows are stored at base[b] + t; expected row0 = n_drop = 0")
    G = T  # programs per (b, kvh): those past T only remove positions from the histogram
    if hist is not None:
        G = max(G, n_drop - T)
    if G == 0:
        return
    # one program per sub-vector of a token (the chain over M is the launch's latency), unless the
    # histogram needs the token's whole combination in one program
    m_per = M if hist is not None else 1
    k_cache, v_cache, values = kv_cache if kv_cache is not None else (keys, keys, keys)
    _pq_encode_launch(
        (B * Hkv * G * (M // m_per),),
        (
            keys,
            centroids,
            phi if ip else centroids,
            base if base is not None else centroids,
            out,
            hist if hist is not None else out,
            k_cache,
            v_cache,
            values,
            advance if advance is not None else out,
        ),
        (
            *keys.stride(),
            *centroids.stride()[:4],
            *out.stride(),
            *k_cache.stride(),
            *v_cache.stride(),
            *values.stride(),
            Hkv,
            T,
            G,
            row0,
            n_drop,
            window,
            cand_lo,
        ),
        dict(
            M=M,
            M_PER=m_per,
            C=C,
            DSUB=dsub,
            BLOCK_D=min(dsub, 64),
            IP=ip,
            HAS_BASE=base is not None,
            HAS_HIST=hist is not None,
            P=C**M,
            STORE_KV=kv_cache is not None,
            ADVANCE=advance is not None,
            KEY_AT_BASE=key_at_base,
            **pdl_meta(keys.device, early=False),
            num_warps=4,
        ),
    )
