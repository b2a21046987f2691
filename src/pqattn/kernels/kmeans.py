"""One Lloyd step of batched k-means for the PQ index build (SPEC §1), fused in one launch.

Grid (programs per group, groups): each program walks its share of one group's points BLOCK_N at
a time, reading them straight from the key cache (a sub-vector of each key, any float dtype) or
from a prepared float32 array (the ip metric's augmented points):
  1. distances to all C centres through one tensor-core product (|c|^2 - 2 x.c; |x|^2 is only
     added for the reported distance), nearest centre, and its squared distance;
  2. the chosen centres as a one-hot [BLOCK_N, C] matrix, whose transposed product with the
     points accumulates per-centre sums (and counts) in registers;
and writes codes, distances and its partial sums. Both products run in tf32x3 (three tf32 passes,
float32 accuracy): plain tf32 rounds the centres to 10 mantissa bits, which on the demo's LLM-like
keys (a few large channels) cut the PQ selection's attention mass from 0.54 to 0.36 (measured on
the H200; tf32x3 and ieee both match the reference). tf32x3 needs more registers and spills.
Partials are summed over the (few) programs of a group by the caller: no atomics, so a seeded
build gives the same index on every run.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pqattn.kernels.select import interpreted

# The autotune space: points per step and warps. Every config is exercised by the tests.
KMEANS_CONFIGS = [
    triton.Config({"BLOCK_N": bn}, num_warps=w, num_stages=1) for bn, w in ((64, 4), (128, 4), (128, 8))
]


def programs_per_group(G: int, n: int, sm_count: int = 132) -> int:
    """About two programs per SM in all (one wave at 4 warps and ~255 registers a thread), at
    least one per group. H200, G=16, n=32K, C=64: 9 programs per group 228-261 us a step,
    17: 136-171 us, 33: 132-165 us."""
    return max(1, min(triton.cdiv(2 * sm_count, max(G, 1)), triton.cdiv(n, 64)))


@triton.jit
def _kmeans_step_kernel(
    x_ptr,
    cent_ptr,
    nvalid_ptr,
    code_ptr,
    dist_ptr,
    sums_ptr,
    counts_ptr,
    M,
    stride_xg,  # stride of a (b, kv-head) pair: groups g = (b * Hkv + kvh) * M + m
    stride_xm,
    stride_xn,
    n,
    chunk,  # points per program (a multiple of BLOCK_N)
    C,
    d,
    PRECISION: tl.constexpr,  # tl.dot input precision: "tf32", "tf32x3" or "ieee"
    CP: tl.constexpr,  # C padded to >= 16 (a tensor-core tile)
    BD: tl.constexpr,  # d padded to a power of two >= 16
    BLOCK_N: tl.constexpr,
):
    p = tl.program_id(0)
    n_prog = tl.num_programs(0)
    g = tl.program_id(1)
    x_base = x_ptr + (g // M).to(tl.int64) * stride_xg + (g % M) * stride_xm
    n_valid = tl.load(nvalid_ptr + g)
    cc = tl.arange(0, CP)
    dd = tl.arange(0, BD)
    cent = tl.load(
        cent_ptr + g.to(tl.int64) * C * d + cc[:, None] * d + dd[None, :],
        mask=(cc[:, None] < C) & (dd[None, :] < d),
        other=0.0,
    )
    c_norm = tl.where(cc < C, tl.sum(cent * cent, axis=1), float("inf"))  # padding never wins
    sums = tl.zeros([CP, BD], dtype=tl.float32)
    counts = tl.zeros([CP], dtype=tl.float32)
    for start in range(p * chunk, tl.minimum((p + 1) * chunk, n), BLOCK_N):
        t = start + tl.arange(0, BLOCK_N)
        valid = t < n_valid
        x = tl.load(
            x_base + t[:, None] * stride_xn + dd[None, :], mask=valid[:, None] & (dd[None, :] < d), other=0.0
        ).to(tl.float32)
        score = c_norm[None, :] - 2.0 * tl.dot(x, tl.trans(cent), input_precision=PRECISION)  # [BLOCK_N, CP]
        best = tl.argmin(score, axis=1)
        dist = tl.maximum(tl.sum(x * x, axis=1) + tl.min(score, axis=1), 0.0)
        tl.store(code_ptr + g.to(tl.int64) * n + t, best, mask=t < n)
        tl.store(dist_ptr + g.to(tl.int64) * n + t, dist, mask=t < n)
        onehot = tl.where((best[:, None] == cc[None, :]) & valid[:, None], 1.0, 0.0)
        sums += tl.dot(tl.trans(onehot), x, input_precision=PRECISION)
        counts += tl.sum(onehot, axis=0)
    part = g.to(tl.int64) * n_prog + p
    tl.store(sums_ptr + part * CP * BD + cc[:, None] * BD + dd[None, :], sums)
    tl.store(counts_ptr + part * CP + cc, counts)


def kmeans_step(
    x: torch.Tensor,
    M: int,
    centroids: torch.Tensor,
    n_valid: torch.Tensor,
    *,
    codes: torch.Tensor,
    dist: torch.Tensor,
    sums: torch.Tensor,
    counts: torch.Tensor,
    config: triton.Config | None = None,
    precision: str = "tf32x3",
) -> None:
    """Assign every point to its nearest centre and write per-program partial sums.

    x: [G // M, M, n, d] view (any float dtype, last dim contiguous) of the points of group
    g = i * M + m at x[i, m]; centroids [G, C, d] float32 contiguous; n_valid [G] int32 (points
    >= n_valid are padding: not counted, codes/dist still written); codes [G, n] int32 and dist
    [G, n] float32 (outputs); sums [G, P, CP, BD] and counts [G, P, CP] float32 (outputs, P =
    programs per group, CP = max(C, 16), BD = next power of two >= max(d, 16)).
    """
    G, C, d = centroids.shape
    n = x.shape[2]
    P = sums.shape[1]
    if config is None:
        config = KMEANS_CONFIGS[0] if interpreted() else KMEANS_CONFIGS[2]  # fewest spills in tf32x3
    # The one-hot product stages [BLOCK_N, CP] tf32x3 operands in shared memory: cap the step so
    # that C = 256 fits (H200: 393 KB needed at 128 x 256, 227 KB available).
    block = min(config.kwargs["BLOCK_N"], max(16, 8192 // sums.shape[2]))
    chunk = triton.cdiv(triton.cdiv(n, P), block) * block
    _kmeans_step_kernel[(P, G)](
        x,
        centroids,
        n_valid,
        codes,
        dist,
        sums,
        counts,
        M,
        x.stride(0),
        x.stride(1),
        x.stride(2),
        n,
        chunk,
        C,
        d,
        PRECISION=precision,
        CP=sums.shape[2],
        BD=sums.shape[3],
        BLOCK_N=block,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )


def lloyd(
    x: torch.Tensor, valid: torch.Tensor, init: torch.Tensor, *, iters: int, tol: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """`pqattn.reference.pq.lloyd` on the GPU: one fused launch per assignment, the same rules.

    x: [G, n, d] points; valid: [G, n] bool, a prefix of each group (points past a sequence's
    length); init: [G, C, d]. Per-group early stop on `tol` (total squared centre shift), empty
    clusters reseeded like the reference (farthest points first). Returns (centroids [G, C, d]
    float32, codes [G, n] int64, objective [iterations + 1, G], iterations). One host sync per
    iteration (the early-stop and empty-cluster flags): this is the prefill path, not decode.
    """
    from pqattn.reference.pq import _reseed_empty

    G, n, d = x.shape
    C = init.shape[1]
    dev = x.device
    sm = torch.cuda.get_device_properties(dev).multi_processor_count if dev.type == "cuda" else 4
    P = programs_per_group(G, n, sm)
    CP, BD = max(C, 16), max(16, 1 << max(d - 1, 0).bit_length())
    xf = x if x.dtype == torch.float32 and x.stride(-1) == 1 else x.float().contiguous()
    n_valid = valid.sum(1).to(torch.int32)
    codes = torch.empty(G, n, dtype=torch.int32, device=dev)
    dist = torch.empty(G, n, dtype=torch.float32, device=dev)
    sums = torch.empty(G, P, CP, BD, dtype=torch.float32, device=dev)
    counts = torch.empty(G, P, CP, dtype=torch.float32, device=dev)

    def step(c: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        kmeans_step(xf[:, None], 1, c, n_valid, codes=codes, dist=dist, sums=sums, counts=counts)
        return sums.sum(1)[:, :C, :d], counts.sum(1)[:, :C]

    c = init.float().contiguous()
    s, cnt = step(c)
    history = [(dist * valid).sum(1)]
    active = torch.ones(G, dtype=torch.bool, device=dev)
    done = 0
    for _ in range(iters):
        empty = (cnt == 0) & (n_valid > 0)[:, None]
        any_active, any_empty = torch.stack([active.any(), empty.any()]).tolist()
        if not any_active:
            break
        new_c = s / cnt.clamp_min(1)[..., None]
        if any_empty:
            new_c = _reseed_empty(new_c, cnt, xf, dist, valid, n_valid)
        shift = ((new_c - c) ** 2).sum((1, 2))
        c = torch.where(active[:, None, None], new_c, c).contiguous()
        active = active & (shift >= tol)
        s, cnt = step(c)
        history.append((dist * valid).sum(1))
        done += 1
    return c, codes.long(), torch.stack(history), done
