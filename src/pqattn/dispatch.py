"""The one layer between the public API (`pqattn.ops`, `PQIndex`, the integrations) and the kernels.

It decides where a call runs (`kernel_path` and its siblings: a Triton kernel, or the PyTorch
reference), sizes the kernels' workspaces, keeps the launch plans of the functional API, and
launches the kernels on inputs the caller has validated. Nothing above it imports a kernel
module; the kernel modules are imported here, when first launched, so that importing pqattn
compiles nothing (Triton fixes a kernel's interpreter mode when it is decorated).

The limits it routes by are `pqattn.limits`.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from pqattn import _validate as check
from pqattn import reference as ref
from pqattn.kernels.select import AppendedKey, NewKey
from pqattn.limits import MAX_COMBOS, MAX_TREE_HEAVY
from pqattn.policy import lookup_tables, select_route
from pqattn.reference import Selection, SelectParams
from pqattn.runtime.launch import PlanCache, unrecorded
from pqattn.runtime.progress import Progress

__all__ = [
    "KERNEL_DEVICES",
    "PLANS",
    "AppendedKey",
    "NewKey",
    "PQCodebook",
    "attention_kernel_path",
    "bad_selection_rows",
    "bucket_tokens",
    "build",
    "count_combos",
    "decode_kernel_path",
    "decode_workspace_numel",
    "encode",
    "flash_forward",
    "kernel_path",
    "row_fetch",
    "row_lookup",
    "row_lookup_workspace_numel",
    "select",
    "select_workspace_numel",
    "sparse_decode",
    "tree_workspace_layout",
    "uses_fine",
    "uses_histogram",
]

# Devices whose tensors take the Triton kernels. Tests add "cpu" under Triton's interpreter to
# run the kernel paths of PQIndex and the functional API on a machine without a GPU.
KERNEL_DEVICES = ("cuda",)

# The functional API's launch plans (`select_topk` and `sparse_decode` given their buffers).
PLANS = PlanCache(64)


class PQCodebook(NamedTuple):
    """The product quantization of a key cache (SPEC §1)."""

    centroids: torch.Tensor  # [B, Hkv, M, C, dsub] (euclidean) or [B, Hkv, M, C, dsub + 1] (ip)
    codes: torch.Tensor  # [B, Hkv, N, M] uint8, by absolute token position
    phi: torch.Tensor | None  # [B, Hkv, M] for ip, None for euclidean


# ---- routes ----------------------------------------------------------------------------------------


def uses_histogram(M: int, C: int) -> bool:
    """True when codes of M sub-vectors of C centroids can keep the combination histogram (and its
    buckets): C**M <= MAX_COMBOS. Which route a call takes: pqattn.policy.select_route."""
    return C**M <= MAX_COMBOS


def uses_fine(M: int, C: int, share: str = "head", heavy: int = 0, rerank: int = 0) -> bool:
    """True when a selection of rows of `heavy` tokens takes the fine-code route
    (`kernels/select/fine.py`; pqattn.policy.select_route)."""
    return select_route(M, C, heavy, share=share, rerank=rerank) == "fine"


def kernel_path(
    q_or_keys: torch.Tensor, centroids: torch.Tensor, heavy: int = 0, share: str = "head", rerank: int = 0
) -> bool:
    """True when selection / encoding of these tensors runs the Triton kernels (else the reference):
    a device of KERNEL_DEVICES, a power-of-two sub-vector width >= 2, and a route that serves the
    case: the fine-code route (any heavy; with rerank, D a power of two in 16..256), C**M <=
    MAX_COMBOS (any heavy) or heavy <= MAX_TREE_HEAVY."""
    D, M, C = q_or_keys.shape[-1], centroids.shape[2], centroids.shape[3]
    dsub = D // M
    fits = uses_fine(M, C, share, heavy, rerank) or uses_histogram(M, C) or heavy <= MAX_TREE_HEAVY
    if rerank and not (16 <= D <= 256 and D & (D - 1) == 0):
        return False
    return q_or_keys.device.type in KERNEL_DEVICES and dsub >= 2 and dsub & (dsub - 1) == 0 and fits


def decode_kernel_path(q: torch.Tensor) -> bool:
    """True when sparse decode of this query runs the Triton kernel: KERNEL_DEVICES, D a power of
    two in 16..256."""
    D = q.shape[-1]
    return q.device.type in KERNEL_DEVICES and 16 <= D <= 256 and D & (D - 1) == 0


def attention_kernel_path(q: torch.Tensor, k: torch.Tensor) -> bool:
    """True when dense attention runs the Triton flash kernel: CUDA, fp16/bf16 q and k of one dtype,
    D a power of two in 16..256 (anything else: the reference)."""
    D = q.shape[-1]
    return (
        q.is_cuda
        and q.dtype in (torch.float16, torch.bfloat16)
        and k.dtype == q.dtype
        and 16 <= D <= 256
        and D & (D - 1) == 0
    )


# ---- workspaces ------------------------------------------------------------------------------------


def select_workspace_numel(
    rows: int,
    M: int,
    C: int,
    n_tokens: int,
    heavy: int,
    *,
    kept_histogram: bool = False,
    buckets: bool = False,
    share: str = "head",
    tables: int = 1,
    rerank: int = 0,
) -> int:
    """int32 elements of the selection's workspace for rows = B * H query rows (B * Hkv for
    share="group") over a token axis of n_tokens, for calls with no histogram kept (select_topk),
    or with one (PQIndex: `kept_histogram`, and `buckets` when it keeps those too). Fine-code
    route: per row `tables` LUTs (G for the group max rule, else 1), the bins and the scores,
    about rows * (n_tokens + 8192) * 4 bytes; histogram selection: about rows * C**M * 5 bytes;
    from buckets: the LUTs and rows * heavy * 8 bytes; merge tree: the LUTs plus the tree's slots,
    about rows * (n_tokens / TILE) * heavy * 8 bytes. Allocate it zero-filled, once; the kernels
    leave it reusable by calls with the same rows, M, C, n_tokens and heavy (their counters lie at
    places that depend on them). rerank=R adds the re-rank's shortlist, rows * R * heavy * 8 bytes."""
    route = select_route(
        M, C, heavy, share=share, rerank=rerank, kept_histogram=kept_histogram, buckets=buckets
    )
    return _ROUTE_WORKSPACE[route](rows, M, C, n_tokens, heavy, tables, rerank)


def _fine_workspace(rows: int, M: int, C: int, n_tokens: int, heavy: int, tables: int, rerank: int) -> int:
    from pqattn.kernels.select import fine

    return fine.workspace_numel(rows, tables, M, C, n_tokens, rerank * heavy)


def _buckets_workspace(rows: int, M: int, C: int, n_tokens: int, heavy: int, tables: int, rerank: int) -> int:
    from pqattn.kernels.select import buckets

    return buckets.workspace_numel(rows, M, C, heavy)


def _hist_workspace(rows: int, M: int, C: int, n_tokens: int, heavy: int, tables: int, rerank: int) -> int:
    from pqattn.kernels.select import hist

    return hist.workspace_numel(rows, M, C)


def _tree_workspace(rows: int, M: int, C: int, n_tokens: int, heavy: int, tables: int, rerank: int) -> int:
    from pqattn.kernels.select import tree

    return tree.workspace_numel(rows, M, C, n_tokens, heavy)


# each selection route's workspace size, by route (pqattn.policy.ROUTES)
_ROUTE_WORKSPACE = {
    "fine": _fine_workspace,
    "buckets": _buckets_workspace,
    "hist": _hist_workspace,
    "tree": _tree_workspace,
}


def tree_workspace_layout(n_tokens: int, heavy: int) -> tuple[int, int]:
    """What the merge tree's workspace layout depends on besides rows, M and C: (its most tree
    nodes, its slot width). A workspace serves calls whose layout is the same."""
    from pqattn.kernels.select.tree import k_pad, max_tree_nodes

    return max_tree_nodes(n_tokens, heavy), k_pad(heavy, n_tokens)


def decode_workspace_numel(rows: int, width: int, D: int, group: int = 0) -> int:
    """int32 elements of the sparse decode kernel's workspace for rows = B * H, list width L, head
    dim D; with `group` = G, of the group kernel for rows = B * Hkv selections shared by G heads,
    or of dense decoding over caches of `width` tokens. Allocate it zero-filled, once; the kernel
    leaves it reusable by calls of the same rows, of any width up to `width`, and D."""
    from pqattn.kernels import decode

    if group:
        return max(
            decode.group_workspace_numel(rows, group, width, D, dense=dense) for dense in (False, True)
        )
    return decode.workspace_numel(rows, width, D)


# ---- launches (validated inputs) -------------------------------------------------------------------


BUILD_PROGRESS_DELAY = 1.0  # seconds: the reference build takes seconds per 16K-token cache on a CPU


def build(
    keys: torch.Tensor,
    lengths: torch.Tensor,
    subvectors: int,
    bits: int,
    metric: str,
    init_offset: int,
    iters: int,
    tol: float,
    seed: int,
    sample: int = 0,
    head_offset: int = 0,
    total_heads: int | None = None,
) -> PQCodebook:
    """The index build (SPEC §1) of validated keys: CUDA keys (fp16/bf16/fp32) run the Lloyd loop
    in Triton (one launch per iteration), anything else, float64 included, the reference; both
    draw the same initial centres for a seed. sample > 0 (euclidean): k-means on at most
    sample * C tokens per sequence, evenly strided over [init_offset, length), then every key
    encoded against those centroids (`sampled_keys`). head_offset / total_heads: the keys are
    those KV heads of a larger cache, whose build they match head for head
    (`reference.pq.group_ids`)."""
    reference = not keys.is_cuda or keys.dtype == torch.float64
    if reference:
        build_pq, encode_keys = ref.build_pq, None
    else:
        from pqattn.kernels.kmeans import build_pq, encode_keys
    common = dict(subvectors=subvectors, bits=bits, metric=metric, iters=iters, tol=tol, seed=seed)
    common |= dict(head_offset=head_offset, total_heads=total_heads)
    C = 1 << bits
    B, Hkv, N, _ = keys.shape
    what = f"pqattn: index build of {B}x{Hkv}x{N} keys, k-means"
    with Progress(what, iters, delay=BUILD_PROGRESS_DELAY) as tick:
        if reference:
            common["tick"] = tick
        if sample <= 0 or N - init_offset <= sample * C:
            res = build_pq(keys, lengths, init_offset=init_offset, **common)
            return PQCodebook(res.centroids, res.codes, res.phi)
        points, counts = sampled_keys(keys, lengths, init_offset, sample * C)
        res = build_pq(points, counts, init_offset=0, **common)
    codes = torch.zeros(B, Hkv, N, subvectors, dtype=torch.uint8, device=keys.device)
    tail = keys[:, :, init_offset:]
    # the bulk encode: point tiles against every centroid (the build's codes launch), else per key
    if encode_keys is None or not encode_keys(keys, lengths, res.centroids, codes, init_offset=init_offset):
        if kernel_path(tail, res.centroids):
            encode(tail, res.centroids, None, codes[:, :, init_offset:])
        else:
            codes[:, :, init_offset:] = ref.encode(tail, res.centroids)
    valid = torch.arange(N, device=keys.device)[None, :] < lengths[:, None]  # [B, N]
    codes.masked_fill_(~valid[:, None, :, None], 0)  # as the full build: 0 past each length
    return PQCodebook(res.centroids, codes, None)


def sampled_keys(
    keys: torch.Tensor, lengths: torch.Tensor, init_offset: int, points: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The keys a sampled build clusters: [B, Hkv, points, D], sequence b's first counts[b] rows
    its tokens init_offset + (i * n_b) // counts[b] with n_b = lengths[b] - init_offset and
    counts[b] = min(n_b, points) (every token when it has no more than `points`); no host sync."""
    B, Hkv, _, D = keys.shape
    n = (lengths.long() - init_offset).clamp_min(0)  # [B]
    counts = n.clamp(max=points)
    i = torch.arange(points, device=keys.device)[None, :]
    at = init_offset + (i * n[:, None]) // counts.clamp_min(1)[:, None]
    at = torch.where(i < counts[:, None], at, init_offset).clamp(max=keys.shape[2] - 1)  # [B, points]
    picked = keys.gather(2, at[:, None, :, None].expand(B, Hkv, points, D))
    return picked, counts


def encode(
    keys: torch.Tensor, centroids: torch.Tensor, phi: torch.Tensor | None, out: torch.Tensor, **kw
) -> None:
    """The encode launch (pqattn.kernels.encode.pq_encode, its keywords): codes of keys [B, Hkv, T, D]
    into `out`, optionally at each sequence's length with the histogram, the caches and the lengths
    kept in the same launch."""
    from pqattn.kernels.encode import pq_encode

    pq_encode(keys, centroids, phi, out, **kw)


def count_combos(codes: torch.Tensor, lengths: torch.Tensor, histogram: torch.Tensor, **kw) -> None:
    """The candidates' combination histogram of the codes (pqattn.kernels.select.hist.count_combos)."""
    from pqattn.kernels.select.hist import count_combos as launch

    launch(codes, lengths, histogram, **kw)


def bucket_tokens(codes: torch.Tensor, lengths: torch.Tensor, *buffers: torch.Tensor, **kw) -> None:
    """Group the candidates by code combination, in place (pqattn.kernels.select.buckets.bucket_tokens)."""
    from pqattn.kernels.select.buckets import bucket_tokens as launch

    launch(codes, lengths, *buffers, **kw)


def select(
    q: torch.Tensor,
    centroids: torch.Tensor,
    codes: torch.Tensor,
    lengths: torch.Tensor,
    params: SelectParams,
    *,
    out: Selection | None,
    workspace: torch.Tensor | None,
    weights: torch.Tensor | None = None,
    code_base: int = 0,
    n_tokens: int | None = None,
    histogram: torch.Tensor | None = None,
    buckets: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    new_key: NewKey | None = None,
    after_encode: bool = False,
    share: str = "head",
    group_rule: str = "sum",
    rerank: int = 0,
    keys: torch.Tensor | None = None,
    block_table: torch.Tensor | None = None,
    appended: AppendedKey | None = None,
) -> Selection:
    """Run the selection kernels, into `out` / `workspace` when given (no allocation then).

    codes row r holds token code_base + r (the original's codebook starts at init_offset);
    n_tokens: the token axis length N (codes.shape[-2] + code_base by default); params.width must
    be `SelectParams.make`'s for it. histogram: the combination counts of the candidates
    [cand_lo, n - window) that the caller keeps (histogram routes only); without it the kernels
    count them first. buckets: the (order, starts, frozen) kept with the histogram (no weights,
    code_base 0): the selection reads those instead of scanning the codes, and with `new_key`
    encodes the step's key in the same launch (pqattn.kernels.select.NewKey). share="group":
    one selection per KV head (rows [B, Hkv]) by the group scores of `group_rule`. rerank=R with
    keys [B, Hkv, N, D] (or paged [num_blocks, P, Hkv, D] with `block_table`): the top heavy
    by exact score among the top R * heavy by PQ score. appended: the step's new key
    (pqattn.kernels.select.AppendedKey; code_base 0), encoded by the fine route's first launch,
    or by the encode launch ahead of the selection on the other routes, with a window of 0 and
    for keys whose last dim is strided.
    """
    B, H, _ = q.shape
    Hkv, M, C = centroids.shape[1], centroids.shape[2], centroids.shape[3]
    N = codes.shape[-2] + code_base if n_tokens is None else n_tokens
    width = params.width
    route = select_route(
        M,
        C,
        params.heavy,
        share=share,
        rerank=rerank,
        kept_histogram=histogram is not None,
        buckets=buckets is not None,
    )
    R = Hkv if share == "group" else H  # selection rows per sequence
    if out is None:
        out = Selection(
            torch.empty(B, R, width, dtype=torch.int32, device=q.device),
            torch.empty(B, R, dtype=torch.int32, device=q.device),
        )
    else:
        check.tensor(
            "out.positions",
            out.positions,
            shape=(B, R, width),
            dims="[B, H, L]" if R == H else "[B, Hkv, L]",
            dtypes=check.INT_DTYPES,
            device=q.device,
        )
        check.tensor(
            "out.counts",
            out.counts,
            shape=(B, R),
            dims="[B, H]" if R == H else "[B, Hkv]",
            dtypes=check.INT_DTYPES,
            device=q.device,
        )
        if not out.counts.is_contiguous():
            raise ValueError("out.counts: expected a contiguous tensor")
    if buckets is not None and (histogram is None or code_base != 0):
        raise ValueError("buckets: expected with a kept histogram and code_base 0")
    tables = lookup_tables(share, group_rule, H // Hkv)
    need = select_workspace_numel(
        B * R,
        M,
        C,
        N,
        params.heavy,
        kept_histogram=histogram is not None,
        buckets=buckets is not None,
        share=share,
        tables=tables,
        rerank=rerank,
    )
    if workspace is None:
        workspace = torch.zeros(need, dtype=torch.int32, device=q.device)
    elif workspace.dtype != torch.int32 or workspace.numel() < need or workspace.device != q.device:
        raise ValueError(
            f"workspace: expected a zero-filled int32 tensor on {q.device} of at least "
            f"select_workspace_numel(B*H, M, C, N, heavy)={need} elements, "
            f"got {workspace.dtype} with {workspace.numel()} on {workspace.device}"
        )
    q = q if q.stride(-1) == 1 else q.contiguous()
    centroids = centroids if centroids.stride(-1) == 1 else centroids.contiguous()
    if appended is not None and not (route == "fine" and params.window >= 1 and _lut_reads(appended)):
        encode(
            appended.keys,
            centroids,
            appended.phi,
            codes,
            base=lengths,
            hist=histogram,
            window=params.window,
            cand_lo=params.cand_lo,
            kv_cache=appended.kv_cache,
            advance=appended.arrivals,
            key_at_base=appended.at_length,
        )
        appended = None
    common = dict(positions=out.positions, counts=out.counts, workspace=workspace, weights=weights)
    if route == "fine":
        from pqattn.kernels.select.fine import pq_select_fine

        pq_select_fine(
            q,
            centroids,
            codes,
            lengths,
            params,
            positions=out.positions,
            counts=out.counts,
            workspace=workspace,
            share=share,
            group_rule=group_rule,
            tables=tables,
            n_tokens=N,
            code_base=code_base,
            rerank=rerank,
            keys=None if keys is None else _last_contiguous(keys),
            block_table=block_table,
            appended=appended,
        )
        if weights is not None:  # the selection's dense weights (entries past the count add 0)
            valid = torch.arange(width, device=q.device) < out.counts[..., None]
            weights.zero_().scatter_add_(-1, out.positions.clamp(min=0).long(), valid.to(weights.dtype))
    elif route == "buckets":
        from pqattn.kernels.select.buckets import pq_select_buckets

        pq_select_buckets(
            q,
            centroids,
            codes,
            lengths,
            params,
            histogram=histogram,
            buckets=buckets,
            new_key=new_key,
            after_encode=after_encode,
            **common,
        )
    elif route == "hist":
        from pqattn.kernels.select.hist import pq_select_hist

        pq_select_hist(
            q,
            centroids,
            codes,
            lengths,
            params,
            histogram=histogram,
            n_tokens=N,
            code_base=code_base,
            **common,
        )
    else:
        from pqattn.kernels.select.tree import pq_select

        pq_select(q, centroids, codes, lengths, params, n_tokens=N, code_base=code_base, **common)
    return out


def _lut_reads(appended: AppendedKey) -> bool:
    """Whether the fine LUT launch reads this key's layout (last dims contiguous)."""
    values = appended.kv_cache[2] if appended.kv_cache is not None else appended.keys
    return appended.keys.stride(-1) == 1 and values.stride(-1) == 1


def sparse_decode(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    counts: torch.Tensor,
    *,
    out: torch.Tensor,
    workspace: torch.Tensor,
    weights: torch.Tensor | None,
    dense_weights: bool,
    lse: torch.Tensor | None,
    scale: float | None,
    block_table: torch.Tensor | None = None,
) -> None:
    """The sparse decode launch on validated inputs: positions [B, H, L] per query head
    (pqattn.kernels.decode.sparse_decode), or [B, Hkv, L] shared by each KV head's G query heads
    (group_decode; no weights); k and v paged [num_blocks, P, Hkv, D] with a block table."""
    from pqattn.kernels import decode

    qkv = (_last_contiguous(q), _last_contiguous(k), _last_contiguous(v))
    common = dict(out=out, workspace=workspace, lse=lse, scale=scale, block_table=block_table)
    if positions.shape[1] != q.shape[1]:
        decode.group_decode(*qkv, positions, counts, **common)
    else:
        decode.sparse_decode(*qkv, positions, counts, weights=weights, dense_weights=dense_weights, **common)


def dense_decode(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    counts: torch.Tensor,
    *,
    out: torch.Tensor,
    workspace: torch.Tensor,
    lse: torch.Tensor | None,
    scale: float | None,
    block_table: torch.Tensor | None = None,
    starts: torch.Tensor | None = None,
) -> None:
    """The dense decode launch on validated inputs (the group decode kernel over the cache's first
    counts[b] tokens, or tokens starts[b] .. counts[b] - 1, no positions): counts, starts [B]."""
    from pqattn.kernels import decode

    Hkv = k.shape[2] if block_table is not None else k.shape[1]
    per_head = counts[:, None].expand(counts.shape[0], Hkv)
    qkv = (_last_contiguous(q), _last_contiguous(k), _last_contiguous(v))
    decode.group_decode(
        *qkv,
        None,
        per_head,
        out=out,
        workspace=workspace,
        lse=lse,
        scale=scale,
        block_table=block_table,
        starts=starts,
    )


def row_lookup_workspace_numel(rows: int, L: int, S: int) -> int:
    """int32 elements of row_lookup's workspace for `rows` lists of width L over S slots."""
    from pqattn.kernels.rows import lookup_workspace_numel

    return lookup_workspace_numel(rows, L, S)


def row_lookup(
    positions: torch.Tensor,
    counts: torch.Tensor,
    cache: ref.RowCache,
    misses: ref.Misses,
    slot_list: torch.Tensor,
    *,
    kernel: bool,
    workspace: torch.Tensor | None = None,
) -> None:
    """The host tier's row-cache step (SPEC §10): pqattn.kernels.rows.lookup_rows (workspace: its
    scratch, `lookup_workspace_numel` int32), or the reference."""
    if not kernel:
        ref.lookup_rows(positions, counts, cache, misses, slot_list)
        return
    from pqattn.kernels.rows import lookup_rows

    lookup_rows(positions, counts, cache, misses, slot_list, workspace=workspace)


def row_fetch(
    rows: torch.Tensor,
    k_new: torch.Tensor,
    v_new: torch.Tensor,
    lengths: torch.Tensor,
    misses: ref.Misses,
    k_slots: torch.Tensor,
    v_slots: torch.Tensor,
    *,
    kernel: bool,
) -> None:
    """Store the step's new rows into the host tier and fetch the misses into their slots
    (pqattn.kernels.rows.fetch_rows, or the reference)."""
    if not kernel:
        ref.fetch_rows(rows, k_new, v_new, lengths, misses, k_slots, v_slots)
        return
    from pqattn.kernels.rows import fetch_rows

    fetch_rows(rows, _last_contiguous(k_new), _last_contiguous(v_new), lengths, misses, k_slots, v_slots)


def bad_selection_rows(positions: torch.Tensor, counts: torch.Tensor, n_tokens: int) -> torch.Tensor:
    """int8 [B * R]: 1 for each row of positions [B, R, L] / counts [B, R] (one device of
    KERNEL_DEVICES, matching shapes) that breaks the list rules over n_tokens (SPEC §3), else 0:
    one launch (pqattn.kernels.lists), never part of a recorded plan."""
    from pqattn.kernels.lists import bad_rows

    out = torch.empty(positions.shape[0] * positions.shape[1], dtype=torch.int8, device=positions.device)
    if out.numel():
        with unrecorded():
            bad_rows(positions, counts, n_tokens, out=out)
    return out


def flash_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    out: torch.Tensor,
    causal: bool,
    scale: float | None,
    lse: torch.Tensor | None,
) -> None:
    """The flash-attention launch (pqattn.kernels.attention.flash_forward) on validated inputs."""
    from pqattn.kernels.attention import flash_forward as launch

    launch(
        _last_contiguous(q),
        _last_contiguous(k),
        _last_contiguous(v),
        out=out,
        causal=causal,
        scale=scale,
        lse=lse,
    )


def _last_contiguous(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()
