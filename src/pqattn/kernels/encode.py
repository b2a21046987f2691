"""PQ encoding of appended keys (SPEC §1, append): the nearest centroid per sub-vector.

One program per (sequence, KV head, new token). Distances are ||c||^2 - 2 <x, c> (the ||x||^2
term does not change the argmin); for the ip metric x is augmented with sqrt(phi - ||x||^2)
first. The code is written straight into the caller's code buffer, at row `base[b] + t` when a
base (the sequence lengths) is given, so an append is one launch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pqattn.kernels.launch import Launcher


@triton.jit
def _pq_encode_kernel(
    k_ptr,
    cent_ptr,
    phi_ptr,
    base_ptr,
    out_ptr,
    stride_kb,
    stride_kk,
    stride_kt,
    stride_cb,
    stride_ck,
    stride_cm,
    stride_cc,
    stride_ob,
    stride_ok,
    stride_on,
    stride_om,
    Hkv,
    T,
    M: tl.constexpr,
    C: tl.constexpr,
    DSUB: tl.constexpr,
    BLOCK_D: tl.constexpr,
    IP: tl.constexpr,
    HAS_BASE: tl.constexpr,
):
    pid = tl.program_id(0)
    t = pid % T
    kvh = (pid // T) % Hkv
    b = pid // (T * Hkv)
    key = k_ptr + b * stride_kb + kvh * stride_kk + t * stride_kt
    cent = cent_ptr + b * stride_cb + kvh * stride_ck
    row = t
    if HAS_BASE:
        row += tl.load(base_ptr + b).to(tl.int32)
    out = out_ptr + b * stride_ob + kvh * stride_ok + row * stride_on
    c_idx = tl.arange(0, C)
    d_idx = tl.arange(0, BLOCK_D)
    for m in tl.static_range(M):
        dot = tl.zeros([C], dtype=tl.float32)
        c_sq = tl.zeros([C], dtype=tl.float32)
        x_sq = tl.zeros([BLOCK_D], dtype=tl.float32)
        for d0 in tl.static_range(0, DSUB, BLOCK_D):
            x = tl.load(key + m * DSUB + d0 + d_idx).to(tl.float32)
            c = tl.load(cent + m * stride_cm + c_idx[:, None] * stride_cc + d0 + d_idx[None, :]).to(
                tl.float32
            )
            dot += tl.sum(c * x[None, :], axis=1)
            c_sq += tl.sum(c * c, axis=1)
            x_sq += x * x
        if IP:
            phi = tl.load(phi_ptr + (b * Hkv + kvh) * M + m).to(tl.float32)
            extra = tl.sqrt(tl.maximum(phi - tl.sum(x_sq, axis=0), 0.0))
            c_extra = tl.load(cent + m * stride_cm + c_idx * stride_cc + DSUB).to(tl.float32)
            dot += extra * c_extra
            c_sq += c_extra * c_extra
        code = tl.argmin(c_sq - 2.0 * dot, axis=0, tie_break_left=True)
        tl.store(out + m * stride_om, code.to(out_ptr.dtype.element_ty))


_pq_encode_launch = Launcher(_pq_encode_kernel)


def pq_encode(
    keys: torch.Tensor,
    centroids: torch.Tensor,
    phi: torch.Tensor | None,
    out: torch.Tensor,
    base: torch.Tensor | None = None,
) -> None:
    """Write codes of keys [B, Hkv, T, D] into out (indexed [b, kvh, row, m] by its strides).

    centroids [B, Hkv, M, C, dsub(+1)] (last dim contiguous); phi [B, Hkv, M] contiguous for ip;
    row = base[b] + t when base [B] is given, else t. Validated inputs only.
    """
    B, Hkv, T, D = keys.shape
    M, C, width = centroids.shape[2], centroids.shape[3], centroids.shape[4]
    dsub = D // M
    ip = width == dsub + 1
    if T == 0:
        return
    _pq_encode_launch(
        (B * Hkv * T,),
        (keys, centroids, phi if ip else centroids, base if base is not None else centroids, out),
        (
            *keys.stride()[:3],
            *centroids.stride()[:4],
            *out.stride(),
            Hkv,
            T,
        ),
        dict(M=M, C=C, DSUB=dsub, BLOCK_D=min(dsub, 64), IP=ip, HAS_BASE=base is not None, num_warps=4),
    )
