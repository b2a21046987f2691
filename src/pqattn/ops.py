"""Public functional API: validated entry points over the references and kernels.

Shapes: B batch, H query heads, Hkv key/value heads (H % Hkv == 0; query head h reads KV head
h // (H / Hkv)), N tokens, D head dim, M sub-vectors (D % M == 0), C = 2**bits centroids.

Each function validates its inputs once (raising ValueError/TypeError that names the argument,
the expected and the given shape/dtype/device) and then runs through `pqattn.dispatch`: CUDA
tensors go to the Triton kernels where one covers the case; everything else (CPU tensors, a
sub-vector width that is not a power of two) runs the PyTorch reference in `pqattn.reference`,
which computes the same answer. `kernel_path` says which one a call takes; the limits it routes
by are `pqattn.limits`.

Values are checked too on a validating call: `lengths` in [0, N] (`select_topk`), and the
first counts[b, h] positions of each row in [0, N) with counts in [0, L] (`sparse_decode`). On a
GPU that reads them on the host (one sync), so it is skipped while a CUDA graph is captured, and a
call that replays a plan (below) checks nothing: the decode loop's steady state never
synchronizes. `PQIndex` tracks its lengths on the host and checks them without a sync.

dtypes: `sparse_decode` takes q in any floating dtype and k, v of one floating dtype (they may
differ from q's; the output is in q's dtype); `dense_attention` takes q, k and v of one dtype.
Non-finite values propagate: NaN or inf in q, or in a key or value that a row attends to, makes
that row's output non-finite; which tokens a selection takes from non-finite scores is
unspecified, but a selection always holds valid positions (docs/SPEC.md §9).

`select_topk` and `sparse_decode` given their `out` and `workspace` (a decode loop's buffers) keep
their kernel launches as a `pqattn.runtime.launch.Plan` per signature of their tensors and
values of their other arguments: a later call that matches replays it, with no checks beyond
that match (the same checks passed for the same shapes, dtypes and devices).
"""

from __future__ import annotations

import torch

from pqattn import _validate as check
from pqattn import dispatch
from pqattn import reference as ref
from pqattn.dispatch import (
    PQCodebook,
    attention_kernel_path,
    decode_kernel_path,
    decode_workspace_numel,
    kernel_path,
    select_workspace_numel,
    uses_fine,
    uses_histogram,
)
from pqattn.limits import MAX_COMBOS, MAX_TREE_HEAVY, STATELESS_TREE_MAX_HEAVY
from pqattn.policy import clamp_row_heavy, row_heavy
from pqattn.reference import Selection, SelectParams
from pqattn.runtime.launch import recording, signature

__all__ = [
    "MAX_COMBOS",
    "MAX_TREE_HEAVY",
    "STATELESS_TREE_MAX_HEAVY",
    "PQCodebook",
    "attention_kernel_path",
    "build_index",
    "decode_kernel_path",
    "decode_workspace_numel",
    "dense_attention",
    "encode_keys",
    "kernel_path",
    "pq_scores",
    "select_oracle",
    "select_pages",
    "select_streaming",
    "select_topk",
    "select_workspace_numel",
    "selection_weights",
    "sparse_decode",
    "uses_fine",
    "uses_histogram",
    "validate_selection",
]

# dense_attention's checks depend only on its tensors' signatures: those it passed are not checked
# again (the checks cost about a third of a call's host time).
_CHECKED_ATTENTION: set[tuple] = set()
_MAX_CHECKED = 64


def build_index(
    keys: torch.Tensor,
    lengths: torch.Tensor | list[int] | None = None,
    *,
    subvectors: int = 2,
    bits: int = 6,
    metric: str = "euclidean",
    init_offset: int = 0,
    iters: int = 10,
    tol: float = 1e-4,
    seed: int = 0,
    sample: int = 0,
    head_offset: int = 0,
    total_heads: int | None = None,
) -> PQCodebook:
    """Build the PQ index of a prefill key cache (SPEC §1): k-means per (sequence, KV head,
    sub-vector), then every key's codes.

    Tokens before `init_offset` are never quantized. Centroids start from C data points drawn by
    `seed` (the same on every device) and take at most `iters` Lloyd iterations; a group stops
    early once its total squared centre shift is below `tol`. CUDA keys (fp16/bf16/fp32) build
    with the Triton kernels, anything else with the reference.

    Args:
        keys: [B, Hkv, N, D] float16/bfloat16/float32/float64.
        lengths: [B] valid tokens per sequence (a tensor or a list), or None for N each. Given,
            they are read on the host to be checked; with None a CUDA build never waits on the GPU
            and can be captured in a CUDA graph.
        subvectors: M, with D % M == 0. bits: C = 2**bits centroids, 1..8.
        metric: "euclidean" or "ip" (maximum inner product through the augmented coordinate).
        init_offset, iters, tol, seed: as above.
        sample: points per centroid, 0 for all. With sample > 0 (euclidean only), k-means runs on
            at most sample * C keys per sequence, evenly strided over [init_offset, length), and
            every key is then encoded against those centroids (FAISS trains on a few hundred
            points per centroid alike); sequences with fewer keys build on all of them.
        head_offset, total_heads: the keys are KV heads head_offset .. head_offset + Hkv of a
            cache of total_heads (None: Hkv), e.g. a tensor-parallel rank's share; the initial
            centres are then drawn as the whole cache's build draws them for those heads, so
            the shards' indexes equal the one-process index.

    Returns:
        PQCodebook(centroids [B, Hkv, M, C, dsub (+1 for ip)] float32 (float64 for float64 keys),
        codes [B, Hkv, N, M] uint8 by absolute position, phi [B, Hkv, M] for ip else None).

    Example:
        >>> keys = torch.randn(1, 2, 256, 16)
        >>> book = build_index(keys, subvectors=2, bits=4, init_offset=4, iters=3)
        >>> book.centroids.shape, book.codes.shape
        (torch.Size([1, 2, 2, 16, 8]), torch.Size([1, 2, 256, 2]))
    """
    check.key_cache("keys", keys)
    B, _, N, D = keys.shape
    if N == 0:
        raise ValueError(f"keys: expected at least one token to index (N >= 1), got shape {list(keys.shape)}")
    check.subvectors(subvectors, D)
    check.bits(bits)
    check.metric(metric)
    check.non_negative_int("init_offset", init_offset)
    check.non_negative_int("iters", iters)
    check.non_negative_int("sample", sample)
    if sample and metric != "euclidean":
        raise ValueError(
            f"sample: the {metric!r} metric builds on every key (its augmentation needs all norms)"
        )
    check.kv_head_share(head_offset, total_heads, keys.shape[1])
    lens = check.lengths(lengths, B, N, keys.device)
    return dispatch.build(
        keys, lens, subvectors, bits, metric, init_offset, iters, tol, seed, sample, head_offset, total_heads
    )


def encode_keys(
    keys: torch.Tensor, centroids: torch.Tensor, phi: torch.Tensor | None = None, *, metric: str = "euclidean"
) -> torch.Tensor:
    """Codes of new keys against existing centroids (SPEC §1's append: no retraining).

    Args:
        keys: [B, Hkv, T, D] float.
        centroids: [B, Hkv, M, C, dsub (+1 for ip)] from `build_index`.
        phi: [B, Hkv, M], the build's phi for the ip metric (None for euclidean).
        metric: the build's metric.

    Returns:
        codes [B, Hkv, T, M] uint8.

    Example:
        >>> book = build_index(torch.randn(1, 2, 256, 16), bits=4, iters=2)
        >>> encode_keys(torch.randn(1, 2, 3, 16), book.centroids).shape
        torch.Size([1, 2, 3, 2])
    """
    check.key_cache("keys", keys)
    check.metric(metric)
    B, Hkv, _, D = keys.shape
    check.tensor("centroids", centroids, shape=(B, Hkv, None, None, None), dims="[B, Hkv, M, C, dsub(+1)]")
    M = centroids.shape[2]
    check.subvectors(M, D)
    want_d = D // M + (metric == "ip")
    check.tensor(
        "centroids",
        centroids,
        shape=(B, Hkv, M, None, want_d),
        dims="[B, Hkv, M, C, dsub(+1)]",
        dtypes=check.FLOAT_DTYPES,
    )
    if metric == "ip":
        if phi is None:
            raise ValueError("phi: the ip metric needs the build's phi [B, Hkv, M], got None")
        check.tensor("phi", phi, shape=(B, Hkv, M), dims="[B, Hkv, M]", dtypes=check.FLOAT_DTYPES)
    check.same_device("keys", keys, centroids=centroids, phi=phi)
    if kernel_path(keys, centroids):
        out = torch.empty(B, Hkv, keys.shape[2], M, dtype=torch.uint8, device=keys.device)
        dispatch.encode(
            keys.contiguous(), centroids.contiguous(), None if phi is None else phi.contiguous(), out
        )
        return out
    return ref.encode(keys, centroids, phi, metric)


def pq_scores(q: torch.Tensor, centroids: torch.Tensor, codes: torch.Tensor) -> torch.Tensor:
    """Approximate scores of every token (SPEC §2): s_j = sum_m <q_m, centroid[code[j, m]][:dsub]>.

    Args:
        q: [B, H, D]. centroids: [B, Hkv, M, C, dsub (+1)]. codes: [B, Hkv, N, M] uint8.

    Returns:
        scores [B, H, N] in the centroids' dtype (the PyTorch reference on every device).

    Example:
        >>> book = build_index(torch.randn(1, 2, 256, 16), bits=4, iters=2)
        >>> pq_scores(torch.randn(1, 4, 16), book.centroids, book.codes).shape
        torch.Size([1, 4, 256])
    """
    check.score_inputs(q, centroids, codes)
    return ref.pq_scores(q, centroids, codes)


def select_topk(
    q: torch.Tensor,
    centroids: torch.Tensor,
    codes: torch.Tensor,
    lengths: torch.Tensor,
    *,
    sink: int,
    window: int,
    heavy: int,
    init_offset: int = 0,
    share: str = "head",
    group_rule: str = "sum",
    group_budget: float | None = None,
    rerank: int = 0,
    keys: torch.Tensor | None = None,
    out: Selection | None = None,
    workspace: torch.Tensor | None = None,
    block_table: torch.Tensor | None = None,
) -> Selection:
    """PQ top-k selection for one decode query per sequence (SPEC §2, §7; native rules).

    Keeps sink [0, sink) and window [n - window, n), and the `heavy` highest-scoring candidates in
    [max(init_offset, sink), n - window) (ties any); sequences with n <= sink + heavy + window keep
    all their tokens. The order of positions carries no meaning. `heavy` counts tokens per query
    head (as in `PQConfig`). With share="group" one selection per KV head serves its G query
    heads, by the group score of `group_rule` ("sum": the sum of the heads' PQ scores; "max":
    their max), keeping row_heavy = group_budget x heavy tokens (None: G x heavy, the rows its
    heads would keep one by one; `pqattn.policy.row_heavy`). rerank=R >= 1 takes the top
    R * row_heavy by PQ score, then the top row_heavy of those by the exact <q, k> from `keys`
    (the fine-code route: three more launches). The defaults select per head by the sum rule;
    `PQConfig()`'s policy is share="group", group_rule="max".

    Args:
        q: [B, H, D] float, H a multiple of Hkv.
        centroids: [B, Hkv, M, C, dsub (+1)]; codes: [B, Hkv, N, M] uint8 (`build_index`).
        lengths: [B] int32/int64, tokens per sequence, in [0, N].
        sink, window, heavy, init_offset: the selection's sizes (non-negative ints; heavy per
            query head).
        share: "head" (positions per query head) or "group" (per KV head: [B, Hkv, L]).
        group_rule: "sum" or "max", the group score (share="group").
        group_budget: a group row's heavy in per-head heavies (None: G).
        rerank: R >= 1 re-ranks a shortlist of R * row_heavy by the exact scores (needs `keys`).
        keys: [B, Hkv, N, D], the key cache (rerank only); paged [num_blocks, P, Hkv, D] with
            `block_table` [B, max_blocks] (SPEC §8).
        out: a Selection of positions [B, H, L] and counts [B, H] to write into (kernel path;
            [B, Hkv, L] and [B, Hkv] for share="group").
        workspace: zero-filled int32 of `select_workspace_numel(B * H, M, C, N, heavy)` elements
            (kernel path; for share="group" `select_workspace_numel(B * Hkv, M, C, N, row_heavy,
            share="group", tables=policy.tables(G))`, with `rerank=R` for a re-rank). With `out`,
            the call allocates nothing, its launches are kept as a plan, and later calls of the
            same signature replay it; one workspace serves calls of one (rows, M, C, N,
            row_heavy), which leave it ready for the next.

    Returns:
        Selection(positions [B, H, L] int32 with L = sink + row_heavy + window, -1 past the
        count; counts [B, H] int32), with Hkv rows for share="group".

    Example:
        >>> keys = torch.randn(1, 2, 256, 16)
        >>> book = build_index(keys, bits=4, init_offset=4, iters=2)
        >>> sel = select_topk(torch.randn(1, 4, 16), book.centroids, book.codes, torch.tensor([256]),
        ...                   sink=4, window=8, heavy=16, init_offset=4)
        >>> sel.positions.shape, sel.counts.tolist()
        (torch.Size([1, 4, 28]), [[28, 28, 28, 28]])
    """
    key = tensors = None
    if out is not None and workspace is not None:
        tensors = (q, centroids, codes, lengths, *out, workspace)
        tensors += tuple(t for t in (keys, block_table) if t is not None)
        key = dispatch.PLANS.key(
            "select_topk", tensors, sink, window, heavy, init_offset, share, group_rule, group_budget, rerank
        )
        plan = dispatch.PLANS.get(key)
        if plan is not None:
            plan(*tensors)
            return out
    check.score_inputs(q, centroids, codes)
    check.batch_lengths(lengths, q.shape[0], q.device)
    check.sizes(sink, window, heavy, init_offset)
    check.length_values(lengths, codes.shape[2])
    check.share_options(share, group_rule, rerank, group_budget)
    group = q.shape[1] // codes.shape[1]
    heavy = clamp_row_heavy(row_heavy(heavy, share, group_budget, group), codes.shape[2])
    if rerank:
        if keys is None:
            raise ValueError("keys: expected the key cache [B, Hkv, N, D] with rerank >= 1, got None")
        if block_table is None:
            check.key_cache("keys", keys)
            check.tensor(
                "keys", keys, shape=(*codes.shape[:3], q.shape[-1]), dims="[B, Hkv, N, D]", device=q.device
            )
        else:
            _, Hkv, N, D = check.paged_cache(keys, keys, block_table, q.shape[0])
            if (Hkv, D) != (codes.shape[1], q.shape[-1]) or codes.shape[2] > N:
                raise ValueError(
                    f"keys: expected a paged cache of Hkv={codes.shape[1]}, D={q.shape[-1]} and at least "
                    f"N={codes.shape[2]} token slots (max_blocks * P), got Hkv={Hkv}, D={D}, {N} slots"
                )
    elif block_table is not None:
        raise ValueError("block_table: expected None without rerank (the selection reads only the index)")
    if kernel_path(q, centroids, heavy, share, rerank):
        params = SelectParams.make(
            sink=sink,
            window=window,
            heavy=heavy,
            cand_lo=max(init_offset, sink),
            short_threshold=sink + heavy + window,
            n_tokens=codes.shape[2],
        )
        with recording() as rec:
            sel = dispatch.select(
                q,
                centroids,
                codes,
                lengths,
                params,
                out=out,
                workspace=workspace,
                share=share,
                group_rule=group_rule,
                rerank=rerank,
                keys=keys,
                block_table=block_table,
            )
        if tensors is not None:
            dispatch.PLANS.keep(key, rec, tensors)
        return sel
    if block_table is not None:
        keys = ref.unpage(keys, block_table)[:, :, : codes.shape[2]]
    return ref.select_pq(
        q,
        centroids,
        codes,
        lengths,
        sink=sink,
        window=window,
        heavy=heavy,
        init_offset=init_offset,
        share=share,
        group_rule=group_rule,
        rerank=rerank,
        keys=keys,
    )


def select_oracle(
    q: torch.Tensor,
    keys: torch.Tensor,
    lengths: torch.Tensor,
    *,
    sink: int,
    window: int,
    heavy: int,
    init_offset: int = 0,
    share: str = "head",
    group_rule: str = "sum",
    group_budget: float | None = None,
) -> Selection:
    """The exact top-k by <q, k> over the same candidates as `select_topk`: the quality yardstick
    (the PyTorch reference on every device: it reads every key).

    Args:
        q: [B, H, D]. keys: [B, Hkv, N, D]. lengths: [B] in [0, N].
        sink, window, heavy, init_offset, share, group_rule, group_budget: as `select_topk`
            (heavy per query head).

    Returns:
        Selection as `select_topk`'s.

    Example:
        >>> keys = torch.randn(1, 2, 256, 16)
        >>> select_oracle(torch.randn(1, 4, 16), keys, torch.tensor([256]), sink=4, window=8, heavy=16).counts
        tensor([[28, 28, 28, 28]], dtype=torch.int32)
    """
    check.exact_selection_inputs(q, keys, lengths, sink, window, heavy, init_offset)
    check.share_options(share, group_rule, 0, group_budget)
    N = keys.shape[2]
    return ref.select_oracle(
        q,
        keys,
        lengths,
        sink=sink,
        window=window,
        heavy=clamp_row_heavy(row_heavy(heavy, share, group_budget, q.shape[1] // keys.shape[1]), N),
        init_offset=init_offset,
        share=share,
        group_rule=group_rule,
    )


def select_pages(
    q: torch.Tensor,
    keys: torch.Tensor,
    lengths: torch.Tensor,
    *,
    sink: int,
    window: int,
    heavy: int,
    page: int = 16,
    init_offset: int = 0,
) -> Selection:
    """Quest-style page selection (SPEC §7), a peer baseline: pages of `page` tokens ranked by
    sum_d max(q_d * kmin_d, q_d * kmax_d) over their per-channel key minima and maxima, taken until
    `heavy` candidate tokens are covered; sink, window, candidates and the short rule as
    `select_topk`. The PyTorch reference on every device: pqattn has no kernel for it.

    Args:
        q: [B, H, D]. keys: [B, Hkv, N, D]. lengths: [B] in [0, N].
        sink, window, heavy, init_offset: as `select_topk`. page: tokens per page.

    Returns:
        Selection as `select_topk`'s.

    Example:
        >>> keys = torch.randn(1, 2, 256, 16)
        >>> select_pages(torch.randn(1, 4, 16), keys, torch.tensor([256]), sink=4, window=16, heavy=32).counts
        tensor([[52, 52, 52, 52]], dtype=torch.int32)
    """
    check.exact_selection_inputs(q, keys, lengths, sink, window, heavy, init_offset)
    check.positive_int("page", page)
    heavy = clamp_row_heavy(heavy, keys.shape[2])
    return ref.select_pages(
        q, keys, lengths, sink=sink, window=window, heavy=heavy, page=page, init_offset=init_offset
    )


def select_streaming(lengths: torch.Tensor, num_heads: int, *, sink: int, window: int) -> Selection:
    """Sink + window only (StreamingLLM): the same tokens for every head.

    Args:
        lengths: [B] tokens per sequence. num_heads: H. sink, window: the kept sizes.

    Returns:
        Selection with positions [B, H, sink + window].

    Example:
        >>> select_streaming(torch.tensor([100, 5]), 2, sink=2, window=3).counts
        tensor([[5, 5],
                [5, 5]], dtype=torch.int32)
    """
    check.tensor("lengths", lengths, shape=(None,), dims="[B]", dtypes=check.INT_DTYPES)
    check.positive_int("num_heads", num_heads)
    check.sizes(sink, window, 0, 0)
    return ref.select_streaming(lengths, num_heads, sink=sink, window=window)


def selection_weights(
    selection: Selection, n_tokens: int, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Dense per-token weights of a selection: 1.0 where selected, 0.0 elsewhere.

    Args:
        selection: positions [B, H, L], counts [B, H]. n_tokens: N. dtype: of the weights.

    Returns:
        weights [B, H, n_tokens].

    Example:
        >>> selection_weights(select_streaming(torch.tensor([6]), 1, sink=1, window=2), 6)
        tensor([[[1., 0., 0., 0., 1., 1.]]])
    """
    check.tensor("selection.positions", selection.positions, shape=(None,) * 3, dtypes=check.INT_DTYPES)
    check.tensor(
        "selection.counts", selection.counts, shape=selection.positions.shape[:2], dtypes=check.INT_DTYPES
    )
    check.positive_int("n_tokens", n_tokens)
    return ref.dense_weights(selection, n_tokens, dtype)


def validate_selection(positions: torch.Tensor, counts: torch.Tensor, n_tokens: int) -> None:
    """Raise ValueError, naming the first bad entry, unless every count lies in [0, L] and the
    first counts[b, r] positions of each row lie in [0, n_tokens) (SPEC §3). Reads the values on
    the host: on a kernel device, one launch flags the bad rows and the host reads a byte a row
    (one sync; the lists themselves are copied only to name a bad entry). Skipped while a CUDA
    graph is captured, which cannot sync.

    Args:
        positions: [B, R, L] int32/int64. counts: [B, R] int32/int64 on the same device.
        n_tokens: N.
    """
    check.tensor("positions", positions, shape=(None,) * 3, dims="[B, R, L]", dtypes=check.INT_DTYPES)
    check.tensor(
        "counts",
        counts,
        shape=positions.shape[:2],
        dims="[B, R]",
        dtypes=check.INT_DTYPES,
        device=positions.device,
    )
    check.non_negative_int("n_tokens", n_tokens)
    _selection_values(positions, counts, n_tokens)


def _selection_values(positions: torch.Tensor, counts: torch.Tensor, n_tokens: int) -> None:
    """validate_selection's value checks on checked shapes."""
    if not check.checking_values(positions):
        return
    on_device = positions.device.type in dispatch.KERNEL_DEVICES
    if on_device and not bool(dispatch.bad_selection_rows(positions, counts, n_tokens).cpu().any()):
        return
    check.selection_values(positions, counts, n_tokens)


def sparse_decode(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    counts: torch.Tensor,
    weights: torch.Tensor | None = None,
    *,
    scale: float | None = None,
    return_lse: bool = False,
    dense_weights: bool = False,
    out: torch.Tensor | None = None,
    workspace: torch.Tensor | None = None,
    block_table: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Weighted attention of one query per sequence over its selected tokens (SPEC §3):
    out = sum_i w_i exp(a_i) v_i / sum_i w_i exp(a_i) over the first counts[b, h] positions, with
    a_i = scale * <q, k_i>. An empty selection gives a zero row (lse -inf). The sum runs over the
    listed entries: a position listed twice counts twice (repeats are not checked).

    Args:
        q: [B, H, D] in any floating dtype, H a multiple of Hkv.
        k, v: [B, Hkv, N, D], one floating dtype (the cache; it may differ from q's).
        positions: [B, H, L] int32/int64, the first counts[b, h] entries in [0, N); or [B, Hkv, L]
            shared by each KV head's query heads (a group selection; no weights then).
        counts: [B, H] int32/int64 in [0, L] ([B, Hkv] with shared positions).
        weights: [B, H, L] > 0 per entry; or [B, H, N] by token position when `dense_weights`
            (the original's weight_list: a weight of 0 drops the token); or None (all 1).
        scale: default 1/sqrt(D). return_lse: also return the log-sum-exp.
        out: [B, H, D] in q's dtype, last dim contiguous, to write into.
        workspace: zero-filled int32 of `decode_workspace_numel(B * H, L, D)` elements (kernel
            path; `decode_workspace_numel(B * Hkv, L, D, group=G)` with shared positions). With
            `out`, the call allocates nothing and its launches are kept as a plan that
            later calls of the same signature replay; one workspace serves calls of one (B * H, L, D).
        block_table: [B, max_blocks] int32/int64 block indices: k and v are then paged caches
            [num_blocks, P, Hkv, D] as vLLM and FlashInfer keep them (SPEC §8); positions stay
            logical, in [0, max_blocks * P).

    Returns:
        out [B, H, D] in q's dtype, and lse [B, H] float32 when `return_lse`.

    Example:
        >>> q, k, v = torch.randn(1, 4, 16), torch.randn(1, 2, 64, 16), torch.randn(1, 2, 64, 16)
        >>> sel = select_streaming(torch.tensor([64]), 4, sink=4, window=8)
        >>> sparse_decode(q, k, v, sel.positions, sel.counts).shape
        torch.Size([1, 4, 16])
    """
    key = tensors = None
    if out is not None and workspace is not None and not return_lse:
        tensors = (q, k, v, positions, counts, out, workspace)
        tensors += tuple(t for t in (weights, block_table) if t is not None)
        key = dispatch.PLANS.key("sparse_decode", tensors, scale, dense_weights, weights is None)
        plan = dispatch.PLANS.get(key)
        if plan is not None:
            plan(*tensors)
            return out
    scale = check.scale(scale)
    B, Hkv, N, D = _decode_cache(q, k, v, block_table)
    H = q.shape[1]
    shared = positions.dim() == 3 and positions.shape[1] == Hkv != H  # one selection per KV head
    R, dims = (Hkv, "[B, Hkv, L]") if shared else (H, "[B, H, L]")
    check.tensor(
        "positions", positions, shape=(B, R, None), dims=dims, dtypes=check.INT_DTYPES, device=k.device
    )
    check.tensor(
        "counts", counts, shape=(B, R), dims=dims[:-4] + "]", dtypes=check.INT_DTYPES, device=k.device
    )
    if shared and weights is not None:
        raise ValueError(
            "weights: expected None with positions shared by a KV head's query heads [B, Hkv, L]"
        )
    if weights is not None:
        check.tensor(
            "weights",
            weights,
            shape=(B, H, N) if dense_weights else positions.shape,
            dims="[B, H, N]" if dense_weights else "[B, H, L]",
            dtypes=check.FLOAT_DTYPES,
            device=k.device,
        )
    _decode_out(out, q, B, H, D)
    _selection_values(positions, counts, N)
    if not decode_kernel_path(q):
        if block_table is not None:
            k, v = ref.unpage(k, block_table), ref.unpage(v, block_table)
        if shared:
            positions, counts = (t.repeat_interleave(H // Hkv, dim=1) for t in (positions, counts))
        if dense_weights and weights is not None:
            weights = weights.gather(-1, positions.long().clamp(0, N - 1))
        res = ref.sparse_decode(q, k, v, positions, counts, weights, scale=scale, return_lse=True)
        return _reference_result(res, out, return_lse)
    if out is None:
        out = torch.empty(B, H, D, dtype=q.dtype, device=q.device)
    need = (
        decode_workspace_numel(B * Hkv, positions.shape[-1], D, group=H // Hkv)
        if shared
        else decode_workspace_numel(B * H, positions.shape[-1], D)
    )
    workspace = _decode_workspace(
        workspace, need, q.device, "decode_workspace_numel(B*H, L, D) (group: (B*Hkv, L, D, group=G))"
    )
    lse = torch.empty(B * H, dtype=torch.float32, device=q.device) if return_lse else None
    with recording() as rec:
        dispatch.sparse_decode(
            q,
            k,
            v,
            positions,
            counts,
            out=out,
            workspace=workspace,
            weights=weights,
            dense_weights=dense_weights,
            lse=lse,
            scale=scale,
            block_table=block_table,
        )
    if tensors is not None:
        dispatch.PLANS.keep(key, rec, tensors)
    return (out, lse.view(B, H)) if return_lse else out


def dense_decode(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    counts: torch.Tensor,
    *,
    scale: float | None = None,
    return_lse: bool = False,
    out: torch.Tensor | None = None,
    workspace: torch.Tensor | None = None,
    block_table: torch.Tensor | None = None,
    starts: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Dense decode attention of one query per sequence over the first counts[b] tokens of its
    cache: `sparse_decode` over positions 0 .. counts[b] - 1, without the positions (split-K flash
    decoding; each key and value row read once for a KV head's G query heads). pqattn's dense
    fallbacks (`HFConfig.dense_layers`, decoding past the capacity, left-padded prompts) and the
    dense baselines run it.

    Args:
        q: [B, H, D] in any floating dtype, H a multiple of Hkv.
        k, v: [B, Hkv, N, D], one floating dtype; or paged with `block_table` (as sparse_decode).
        counts: [B] int32/int64 in [0, N]: each sequence's tokens (a static cache's slots past
            them are not read).
        scale: default 1/sqrt(D). return_lse: also return the log-sum-exp.
        out: [B, H, D] in q's dtype, last dim contiguous, to write into.
        workspace: zero-filled int32 of `decode_workspace_numel(B * Hkv, N, D, group=H // Hkv)`
            elements (N: the cache's tokens, max_blocks * P when paged). With `out`, the call
            allocates nothing and later calls of its signature replay its launch.
        starts: [B] int32/int64 in [0, counts[b]], or None: each sequence attends to tokens
            starts[b] .. counts[b] - 1 (the tokens before, a left-padded prompt's padding, are not
            read).

    Returns:
        out [B, H, D] in q's dtype, and lse [B, H] float32 when `return_lse`.
    """
    key = tensors = None
    if out is not None and workspace is not None and not return_lse:
        tensors = (q, k, v, counts, out, workspace)
        tensors += (block_table,) if block_table is not None else ()
        tensors += (starts,) if starts is not None else ()
        key = dispatch.PLANS.key("dense_decode", tensors, scale, block_table is not None, starts is not None)
        plan = dispatch.PLANS.get(key)
        if plan is not None:
            plan(*tensors)
            return out
    scale = check.scale(scale)
    B, Hkv, N, D = _decode_cache(q, k, v, block_table)
    H = q.shape[1]
    check.tensor("counts", counts, shape=(B,), dims="[B]", dtypes=check.INT_DTYPES, device=k.device)
    _decode_out(out, q, B, H, D)
    check.length_values(counts, N, "counts")
    if starts is not None:
        check.tensor("starts", starts, shape=(B,), dims="[B]", dtypes=check.INT_DTYPES, device=k.device)
        check.start_values(starts, counts)
    if not decode_kernel_path(q):
        if block_table is not None:
            k, v = ref.unpage(k, block_table), ref.unpage(v, block_table)
        res = ref.dense_decode(q, k, v, counts, starts=starts, scale=scale, return_lse=True)
        return _reference_result(res, out, return_lse)
    if out is None:
        out = torch.empty(B, H, D, dtype=q.dtype, device=q.device)
    need = decode_workspace_numel(B * Hkv, N, D, group=H // Hkv)
    workspace = _decode_workspace(workspace, need, q.device, "decode_workspace_numel(B*Hkv, N, D, group=G)")
    lse = torch.empty(B * H, dtype=torch.float32, device=q.device) if return_lse else None
    with recording() as rec:
        dispatch.dense_decode(
            q,
            k,
            v,
            counts,
            out=out,
            workspace=workspace,
            lse=lse,
            scale=scale,
            block_table=block_table,
            starts=starts,
        )
    if tensors is not None:
        dispatch.PLANS.keep(key, rec, tensors)
    return (out, lse.view(B, H)) if return_lse else out


def _decode_cache(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_table: torch.Tensor | None
) -> tuple[int, int, int, int]:
    """A decode call's cache (contiguous, or paged with its table) and query checked; returns
    (B, Hkv, N, D)."""
    if block_table is None:
        check.key_cache("k", k)
        B, Hkv, N, D = k.shape
        check.tensor("v", v, shape=(B, Hkv, N, D), dims="[B, Hkv, N, D]", dtypes=(k.dtype,), device=k.device)
    else:
        B, Hkv, N, D = check.paged_cache(k, v, block_table, q.shape[0] if q.dim() == 3 else None)
    check.query(q, B, Hkv, D, k.device)
    return B, Hkv, N, D


def _decode_out(out: torch.Tensor | None, q: torch.Tensor, B: int, H: int, D: int) -> None:
    if out is not None:
        check.tensor("out", out, shape=(B, H, D), dims="[B, H, D]", dtypes=(q.dtype,), device=q.device)
        if out.stride(-1) != 1:
            raise ValueError(f"out: expected a contiguous last dimension, got strides {tuple(out.stride())}")


def _decode_workspace(
    workspace: torch.Tensor | None, need: int, device: torch.device, what: str
) -> torch.Tensor:
    """The given workspace checked (int32, at least `need` elements, on `device`), or a new one."""
    if workspace is None:
        return torch.zeros(need, dtype=torch.int32, device=device)
    if workspace.dtype != torch.int32 or workspace.numel() < need or workspace.device != device:
        raise ValueError(
            f"workspace: expected a zero-filled int32 tensor on {device} of at least {what}={need} elements, "
            f"got {workspace.dtype} with {workspace.numel()} on {workspace.device}"
        )
    return workspace


def _reference_result(
    res: tuple, out: torch.Tensor | None, return_lse: bool
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """A reference route's (out, lse) as the kernel route returns them (into `out` when given)."""
    if out is not None:
        out.copy_(res[0])
    res = (res[0] if out is None else out, res[1].float())
    return res if return_lse else res[0]


# Signatures of paged_append calls whose values were checked (bounded: a serving loop has few).
_PAGED_CHECKED: set[tuple] = set()
_MAX_PAGED_CHECKED = 64


def paged_append(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    lengths: torch.Tensor,
    k_new: torch.Tensor,
    v_new: torch.Tensor,
) -> None:
    """Write each sequence's new key and value into a paged cache at its length (SPEC §8), in
    place; the caller advances `lengths` after. Capturable in a CUDA graph. The block indices and
    lengths are read on the host (one sync) at the first call of each signature of the inputs
    (shapes, strides, dtypes, device) outside a capture; later calls of that signature, a decode
    loop's steps, check shapes only, as a kept launch plan does.

    Args:
        k_cache, v_cache: [num_blocks, P, Hkv, D], one floating dtype.
        block_table: [B, max_blocks] int32/int64 block indices in [0, num_blocks).
        lengths: [B] int32/int64 in [0, max_blocks * P): the slot each new token takes.
        k_new, v_new: [B, Hkv, D] (cast to the cache's dtype).

    Example:
        >>> k = torch.zeros(4, 2, 1, 8); v = torch.zeros(4, 2, 1, 8)
        >>> table = torch.tensor([[2, 0]]); n = torch.tensor([3])
        >>> paged_append(k, v, table, n, torch.ones(1, 1, 8), torch.ones(1, 1, 8))
        >>> float(k[0, 1].sum())  # token 3: block table[0, 1] = 0, slot 1
        8.0
    """
    sig = signature(k_cache, v_cache, block_table, lengths, k_new, v_new)
    if sig is not None and sig in _PAGED_CHECKED:
        ref.paged_append(k_cache, v_cache, block_table, lengths, k_new, v_new)
        return
    B, Hkv, N, D = check.paged_cache(k_cache, v_cache, block_table, None)
    for name, t in (("k_new", k_new), ("v_new", v_new)):
        check.tensor(
            name, t, shape=(B, Hkv, D), dims="[B, Hkv, D]", dtypes=check.FLOAT_DTYPES, device=k_cache.device
        )
    check.tensor("lengths", lengths, shape=(B,), dims="[B]", dtypes=check.INT_DTYPES, device=k_cache.device)
    if check.checking_values(lengths):
        host = lengths.detach().cpu()
        if bool(((host < 0) | (host >= N)).any()):
            raise ValueError(f"lengths: expected slots in [0, {N}) (max_blocks * P), got {host.tolist()}")
        if len(_PAGED_CHECKED) >= _MAX_PAGED_CHECKED:
            _PAGED_CHECKED.clear()
        _PAGED_CHECKED.add(sig)
    ref.paged_append(k_cache, v_cache, block_table, lengths, k_new, v_new)


def dense_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = False,
    scale: float | None = None,
    return_lse: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention (SPEC §4), full or causal (query i sees keys j <= i + Sk - Sq), GQA.
    CUDA fp16/bf16 with a power-of-two D of 16..256 runs the Triton flash kernel
    (`attention_kernel_path`), anything else the reference.

    Args:
        q: [B, H, Sq, D]; k, v: [B, Hkv, Sk, D]; q, k and v of one floating dtype.
        causal: bottom-right causal mask. scale: default 1/sqrt(D). return_lse: also return it.

    Returns:
        out [B, H, Sq, D] in q's dtype, and lse [B, H, Sq] float32 when `return_lse`.

    Example:
        >>> q, k = torch.randn(1, 4, 3, 16), torch.randn(1, 2, 5, 16)
        >>> dense_attention(q, k, k, causal=True).shape
        torch.Size([1, 4, 3, 16])
    """
    scale = check.scale(scale)
    sig = signature(q, k, v)
    if sig is None or sig not in _CHECKED_ATTENTION:
        check.key_cache("k", k)
        B, Hkv, Sk, D = k.shape
        check.tensor(
            "v", v, shape=(B, Hkv, Sk, D), dims="[B, Hkv, Sk, D]", dtypes=(k.dtype,), device=k.device
        )
        check.tensor(
            "q", q, shape=(B, None, None, D), dims="[B, H, Sq, D]", dtypes=check.FLOAT_DTYPES, device=k.device
        )
        if q.dtype != k.dtype:
            raise TypeError(f"q: expected k's dtype {k.dtype} (q, k and v share one dtype), got {q.dtype}")
        check.gqa(q.shape[1], Hkv, kv_name="k")
        if len(_CHECKED_ATTENTION) >= _MAX_CHECKED:
            _CHECKED_ATTENTION.clear()
        _CHECKED_ATTENTION.add(sig)
    if not attention_kernel_path(q, k):
        return ref.dense_attention(q, k, v, causal=causal, scale=scale, return_lse=return_lse)
    B, H, Sq, _ = q.shape
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    lse = torch.empty(B, H, Sq, dtype=torch.float32, device=q.device) if return_lse else None
    dispatch.flash_forward(q, k, v, out=out, causal=causal, scale=scale, lse=lse)
    return (out, lse) if return_lse else out
