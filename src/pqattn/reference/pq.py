"""PQ index build and encoding (SPEC §1) and approximate scores (SPEC §2), in plain PyTorch.

The build treats every (b, kv-head, sub-vector m) as an independent k-means problem, a "group".
Groups are batched along a leading axis G = B * Hkv * M; ragged sequences are handled with a
validity mask over the token axis, so a group's result never depends on the other groups.

Layout conventions (the native ones every kernel follows):
  centroids [B, Hkv, M, C, dsub (+1 for ip)]  in the compute dtype (float32, or float64)
  codes     [B, Hkv, N, M] uint8, indexed by absolute token position; positions before
            init_offset (and at or beyond a sequence's length) hold 0 and carry no meaning
  phi       [B, Hkv, M] for ip (None for euclidean)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch

# Bound on G * tokens * C elements of one distance block, so builds with C=256 over 128K tokens
# stay within a few hundred MB; on a CPU, blocks of a few MB stay in its caches.
_ASSIGN_BLOCK_ELEMS = 1 << 25
_ASSIGN_BLOCK_ELEMS_CPU = 1 << 20


def _block_tokens(x: torch.Tensor, G: int, C: int) -> int:
    """Tokens per block of the [G, tokens, C] distance and one-hot products over x's device."""
    elems = _ASSIGN_BLOCK_ELEMS_CPU if x.device.type == "cpu" else _ASSIGN_BLOCK_ELEMS
    return max(1, elems // max(1, G * C))


class KMeansResult(NamedTuple):
    centroids: torch.Tensor  # [B, Hkv, M, C, dsub(+1)]
    codes: torch.Tensor  # [B, Hkv, N, M] uint8
    phi: torch.Tensor | None  # [B, Hkv, M] (ip) or None
    # [rounds, B, Hkv, M]: sum of squared distances after each assignment; a stopped group's rows
    # repeat its last value. The reference has iterations + 1 rounds, the GPU build iters + 1.
    objective: torch.Tensor
    # Lloyd iterations run (the longest-running group's count): an int from the reference, a 0-d
    # int tensor on the device from the GPU build (reading it would make the build wait).
    iterations: int | torch.Tensor


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp16/bf16 inputs are clustered in float32; float64 stays float64 (reference-grade runs)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def augment_ip(x: torch.Tensor, phi: torch.Tensor) -> torch.Tensor:
    """Append sqrt(phi - ||x||^2) (clamped at 0) so that L2-nearest = max inner product.

    x: [..., n, dsub], phi: [...] broadcastable against x's leading axes.
    """
    extra = (phi[..., None] - (x * x).sum(-1)).clamp_min(0).sqrt()
    return torch.cat([x, extra[..., None]], dim=-1)


def assign(x: torch.Tensor, centroids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Nearest centroid in L2 for each point, per group.

    x: [G, n, d], centroids: [G, C, d] -> (index [G, n] int64, squared distance [G, n]).
    Ties go to the lowest centroid index (torch.min's rule).
    """
    G, n, _ = x.shape
    C = centroids.shape[1]
    c_norm = (centroids * centroids).sum(-1)  # [G, C]
    step = _block_tokens(x, G, C)
    idx_parts, dist_parts = [], []
    for s in range(0, n, step):
        xb = x[:, s : s + step]
        d = (
            (xb * xb).sum(-1, keepdim=True)
            - 2 * torch.bmm(xb, centroids.transpose(1, 2))
            + c_norm[:, None, :]
        )
        dist, idx = d.clamp_min(0).min(dim=-1)
        idx_parts.append(idx)
        dist_parts.append(dist)
    if not idx_parts:
        empty = x.new_zeros((G, 0))
        return empty.long(), empty
    return torch.cat(idx_parts, 1), torch.cat(dist_parts, 1)


HASH_MASK = (1 << 32) - 1


def hash32(x: torch.Tensor | int) -> torch.Tensor | int:
    """A 32-bit integer mix (xor-shift-multiply) of values in [0, 2**32), in int64 arithmetic.

    Both multipliers are below 2**31, so no intermediate overflows int64: a CPU tensor, a CUDA
    tensor, a Python int and the Triton init kernel (uint32 arithmetic) agree bit for bit.
    """
    x = x ^ (x >> 16)
    x = (x * 0x21F0AAAD) & HASH_MASK
    x = x ^ (x >> 15)
    x = (x * 0x735A2D97) & HASH_MASK
    return x ^ (x >> 15)


def init_positions(
    n_valid: torch.Tensor, C: int, seed: int, group_ids: torch.Tensor | None = None
) -> torch.Tensor:
    """Indices [G, C] int64 (on n_valid's device) of each group's initial centres among its
    n_valid[g] valid points: a seeded stratified draw.

    Centre j takes one point of stratum j, the points [j * nv // C, (j + 1) * nv // C): which one
    is hash(seed, g, j) modulo the stratum's size. The C picks are distinct, spread over the whole
    sequence (a token cache's keys drift with position), and cost O(C) per group with no host
    round trip, so the GPU build draws them inside its init kernel; the hash gives the same
    picks on every device. A group with fewer than C points cycles through all of them
    (centre j = point j mod nv); an empty group's picks are 0 and its centres zero.
    Seeds are taken modulo 2**32. group_ids [G]: the g each group hashes (default 0..G-1; see
    `group_ids`).
    """
    G = n_valid.shape[0]
    dev = n_valid.device
    nv = n_valid.long()[:, None]
    j = torch.arange(C, device=dev)[None, :]
    g = (torch.arange(G, device=dev) if group_ids is None else group_ids.long())[:, None]
    h = hash32(hash32(hash32(seed & HASH_MASK) ^ g) ^ j)
    lo = j * nv // C
    size = ((j + 1) * nv // C - lo).clamp_min(1)
    return torch.where(nv >= C, lo + h % size, j % nv.clamp_min(1))


def group_ids(B: int, Hkv: int, M: int, head_offset: int = 0, total_heads: int | None = None) -> torch.Tensor:
    """The g that the init hashes for the groups (b, h, m) of keys [B, Hkv, ...] with M sub-vectors,
    in that order: (b * total_heads + head_offset + h) * M + m. Keys that are KV heads
    head_offset.. of a cache of total_heads (a tensor-parallel rank's share) draw the initial
    centres that the whole cache's build draws for those heads."""
    total = Hkv if total_heads is None else total_heads
    g = torch.arange(B * Hkv * M)
    return (g // (Hkv * M) * total + head_offset) * M + g % (Hkv * M)


def _init_centres(
    x: torch.Tensor,
    valid: torch.Tensor,
    n_valid: torch.Tensor,
    C: int,
    seed: int,
    ids: torch.Tensor | None = None,
) -> torch.Tensor:
    """Initial centres [G, C, d]: the points `init_positions` picks for groups `ids` (default
    0..G-1; zeros for empty groups)."""
    G, n, d = x.shape
    if n == 0:
        return x.new_zeros((G, C, d))
    pick = init_positions(n_valid, C, seed, None if ids is None else ids.to(x.device))
    init = x.gather(1, pick[..., None].expand(G, C, d))
    return init * (n_valid > 0)[:, None, None]


def _reseed_empty(
    centroids: torch.Tensor,
    counts: torch.Tensor,
    x: torch.Tensor,
    dist: torch.Tensor,
    valid: torch.Tensor,
    n_valid: torch.Tensor,
) -> torch.Tensor:
    """Move each empty cluster onto a data point: the farthest points from their centres first.

    The e-th empty cluster (in index order) takes the (e mod min(n_valid, C))-th valid point in
    (distance descending, position ascending) order: ties are broken by position so that every
    implementation picks the same points. Never raises the objective: an empty cluster
    contributes nothing before the move, and the next assignment can only lower the sum.
    """
    empty = (counts == 0) & (n_valid > 0)[:, None]  # [G, C]
    G, C = counts.shape
    n = x.shape[1]
    if n == 0 or not bool(empty.any()):
        return centroids
    order = dist.masked_fill(~valid, -1.0).sort(dim=1, descending=True, stable=True).indices
    far = order[:, : min(C, n)]  # [G, min(C, n)]
    rank = (empty.long().cumsum(1) - 1).clamp_min(0)
    rank = rank % n_valid.clamp_min(1).clamp_max(far.shape[1])[:, None]
    point = far.gather(1, rank)  # [G, C]
    seeds = x.gather(1, point[..., None].expand(G, C, x.shape[-1]))
    return torch.where(empty[..., None], seeds, centroids)


def _segment_sums(
    xv: torch.Tensor, idx: torch.Tensor, valid: torch.Tensor, C: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-cluster sums [G, C, d] and counts [G, C] of masked points xv [G, n, d] assigned idx [G, n].

    On a GPU a one-hot matrix product in fixed blocks rather than scatter_add: CUDA's scatter_add
    uses atomics, whose summation order (and so the result) changes from run to run, and a seeded
    build must give the same index every time. A CPU's index_add_ is deterministic.
    """
    G, n, d = xv.shape
    sums = xv.new_zeros((G, C, d))
    counts = xv.new_zeros((G, C))
    if xv.device.type == "cpu":
        slot = (idx + torch.arange(G, device=idx.device)[:, None] * C).reshape(-1)
        sums.view(G * C, d).index_add_(0, slot, xv.reshape(G * n, d))
        counts.view(G * C).index_add_(0, slot, valid.reshape(G * n).to(xv.dtype))
        return sums, counts
    step = _block_tokens(xv, G, C)
    for s in range(0, n, step):
        onehot = torch.nn.functional.one_hot(idx[:, s : s + step], C).to(xv.dtype)
        onehot = onehot * valid[:, s : s + step, None]
        sums += onehot.transpose(1, 2) @ xv[:, s : s + step]
        counts += onehot.sum(1)
    return sums, counts


def lloyd(
    x: torch.Tensor,
    valid: torch.Tensor,
    init: torch.Tensor,
    *,
    iters: int,
    tol: float,
    tick: Callable[[int], None] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """Batched Lloyd iterations with per-group early stop.

    x: [G, n, d] points, valid: [G, n] bool, init: [G, C, d].
    A group stops once its total squared centre shift in one iteration is below `tol`; its
    centroids are then frozen, so batching never changes a group's result. `tick(done)` is
    called after each iteration (progress).
    Returns (centroids [G, C, d], codes [G, n] int64, objective [iterations + 1, G], iterations).
    """
    G = x.shape[0]
    C = init.shape[1]
    n_valid = valid.sum(1)
    xv = x * valid[..., None]
    c = init.clone()
    active = torch.ones(G, dtype=torch.bool, device=x.device)
    idx, dist = assign(x, c)
    history = [(dist * valid).sum(1)]
    done = 0
    for _ in range(iters):
        if not bool(active.any()):
            break
        sums, counts = _segment_sums(xv, idx, valid, C)
        new_c = sums / counts.clamp_min(1)[..., None]
        new_c = _reseed_empty(new_c, counts, x, dist, valid, n_valid)
        shift = ((new_c - c) ** 2).sum((1, 2))
        c = torch.where(active[:, None, None], new_c, c)
        active = active & (shift >= tol)
        idx, dist = assign(x, c)
        history.append((dist * valid).sum(1))
        done += 1
        if tick:
            tick(done)
    return c, idx, torch.stack(history), done


def _group_points(
    keys: torch.Tensor, lengths: torch.Tensor, subvectors: int, init_offset: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """keys [B, Hkv, N, D] -> points [G, n, dsub] over tokens init_offset..N and a validity mask."""
    B, Hkv, N, D = keys.shape
    dsub = D // subvectors
    n = max(N - init_offset, 0)
    x = keys[:, :, init_offset:, :].to(compute_dtype(keys.dtype))
    x = x.reshape(B, Hkv, n, subvectors, dsub).permute(0, 1, 3, 2, 4).reshape(B * Hkv * subvectors, n, dsub)
    pos = torch.arange(init_offset, init_offset + n, device=keys.device)
    valid = (pos[None, :] < lengths[:, None]).repeat_interleave(Hkv * subvectors, dim=0)
    return x, valid


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
    tick: Callable[[int], None] | None = None,
) -> KMeansResult:
    """k-means PQ index of keys [B, Hkv, N, D] over tokens init_offset..lengths[b] (SPEC §1).

    Init: C distinct data points per group, one from each of C equal strata of its tokens, drawn
    by `init_positions` from `seed` (or `init` [B, Hkv, M, C, dsub(+1)] given explicitly, e.g. to compare two
    implementations from one init). head_offset / total_heads: the keys are those KV heads of a
    larger cache (`group_ids`), whose build they then match head for head. `tick(i)`: called
    after each Lloyd iteration (progress).
    """
    B, Hkv, N, _ = keys.shape
    M, C = subvectors, 1 << bits
    x, valid = _group_points(keys, lengths, M, init_offset)
    n_valid = valid.sum(1)
    phi = None
    if metric == "ip":
        norms = (x * x).sum(-1).masked_fill(~valid, 0.0)
        phi = norms.amax(1) if x.shape[1] else norms.new_zeros(norms.shape[0])
        x = augment_ip(x, phi)
    if init is None:
        c0 = _init_centres(x, valid, n_valid, C, seed, group_ids(B, Hkv, M, head_offset, total_heads))
    else:
        c0 = init.reshape(B * Hkv * M, C, x.shape[-1]).to(x.dtype)
    c, idx, history, done = lloyd(x, valid, c0, iters=iters, tol=tol, tick=tick)

    codes = torch.zeros((B, Hkv, N, M), dtype=torch.uint8, device=keys.device)
    quantized = idx.masked_fill(~valid, 0).to(torch.uint8).reshape(B, Hkv, M, -1).permute(0, 1, 3, 2)
    codes[:, :, init_offset:, :] = quantized
    return KMeansResult(
        centroids=c.reshape(B, Hkv, M, C, x.shape[-1]),
        codes=codes,
        phi=None if phi is None else phi.reshape(B, Hkv, M),
        objective=history.reshape(-1, B, Hkv, M),
        iterations=done,
    )


def encode(
    keys: torch.Tensor, centroids: torch.Tensor, phi: torch.Tensor | None = None, metric: str = "euclidean"
) -> torch.Tensor:
    """Codes [B, Hkv, T, M] uint8 of new keys [B, Hkv, T, D] against existing centroids.

    Same metric as the build: for ip each sub-vector is augmented with the build's phi first.
    """
    B, Hkv, T, D = keys.shape
    M, C = centroids.shape[2], centroids.shape[3]
    dsub = D // M
    x = keys.to(centroids.dtype).reshape(B, Hkv, T, M, dsub).permute(0, 1, 3, 2, 4)  # [B, Hkv, M, T, dsub]
    if metric == "ip":
        x = augment_ip(x, phi)
    idx, _ = assign(x.reshape(B * Hkv * M, T, -1), centroids.reshape(B * Hkv * M, C, -1))
    return idx.to(torch.uint8).reshape(B, Hkv, M, T).permute(0, 1, 3, 2).contiguous()


def pq_scores(
    q: torch.Tensor, centroids: torch.Tensor, codes: torch.Tensor, *, lut_dtype: torch.dtype | None = None
) -> torch.Tensor:
    """Approximate scores s[b, h, j] = sum_m <q_m, centroid[b, kvh, m, codes[b, kvh, j, m]][:dsub]>.

    q: [B, H, D], centroids: [B, Hkv, M, C, dsub(+1)], codes: [B, Hkv, N, M] -> [B, H, N] in the
    centroids' dtype. Built from a per-(b, h) lookup table of <q_m, centroid> (the "LUT");
    `lut_dtype` rounds each entry to that dtype before the sum (SPEC §2's per-head score takes
    None; a group's takes GROUP_LUT_DTYPE, `group_pq_scores`).
    """
    B, H, D = q.shape
    Hkv, M = centroids.shape[1], centroids.shape[2]
    N = codes.shape[2]
    g, dsub = H // Hkv, D // M
    qm = q.to(centroids.dtype).reshape(B, Hkv, g, M, dsub)
    lut = torch.einsum("bkgmd,bkmcd->bkgmc", qm, centroids[..., :dsub])  # [B, Hkv, g, M, C]
    if lut_dtype is not None:
        lut = lut.to(lut_dtype).to(centroids.dtype)
    idx = codes.long().permute(0, 1, 3, 2)[:, :, None].expand(B, Hkv, g, M, N)
    return lut.gather(-1, idx).sum(3).reshape(B, H, N)


# SPEC §7: a group selection's LUT entries are rounded to this dtype before the sum over
# sub-quantizers (half the bytes a lookup reads; the trained model's bits/byte unchanged,
# docs/kernels/select.md).
GROUP_LUT_DTYPE = torch.bfloat16


def group_pq_scores(q: torch.Tensor, centroids: torch.Tensor, codes: torch.Tensor, rule: str) -> torch.Tensor:
    """A KV head's group PQ scores [B, Hkv, N] (SPEC §7) from q [B, H, D], centroids [B, Hkv,
    M, C, dsub(+1)] and codes [B, Hkv, N, M], with LUT entries rounded to GROUP_LUT_DTYPE:
    "sum" scores the G heads' summed query with one LUT, "max" takes the max of the G heads'
    scores, each from its own LUT."""
    B, H, D = q.shape
    Hkv = centroids.shape[1]
    if rule == "sum":
        summed = q.to(centroids.dtype).reshape(B, Hkv, H // Hkv, D).sum(2)
        return pq_scores(summed, centroids, codes, lut_dtype=GROUP_LUT_DTYPE)
    if rule == "max":
        per_head = pq_scores(q, centroids, codes, lut_dtype=GROUP_LUT_DTYPE)
        return per_head.reshape(B, Hkv, H // Hkv, -1).amax(2)
    raise ValueError(f"group_rule: expected one of ('sum', 'max'), got {rule!r}")


def exact_scores(q: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """Exact <q[b, h], k[b, h // g, j]> as [B, H, N] (the oracle's scores), float32 or float64."""
    B, H, D = q.shape
    Hkv, N = keys.shape[1], keys.shape[2]
    dt = compute_dtype(q.dtype if q.dtype == torch.float64 else keys.dtype)
    qg = q.to(dt).reshape(B, Hkv, H // Hkv, D)
    return torch.einsum("bkgd,bknd->bkgn", qg, keys.to(dt)).reshape(B, H, N)
