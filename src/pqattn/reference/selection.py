"""Decode-time token selection (SPEC §2, §7): PQ top-k, streaming, the exact-score oracle, pages.

A selection for sequence b and query head h is a set of token positions. It is stored as
positions [B, H, L] (int32; entries at index >= count are -1) with counts [B, H] (int32).
The reference writes the parts in the order sink, heavy (by descending score), window; the order
carries no meaning and tests compare selections as sets.

Native rules (the compatible entry point of SPEC §5 uses the original's short-sequence rule):
  * always kept: sink [0, min(sink, n)) and window [n - min(window, n), n);
  * heavy candidates: max(init_offset, sink) <= p < n - window. Sink positions are left out of the
    candidates so that the three parts never overlap; with the usual init_offset >= sink this is
    exactly SPEC §2's range;
  * short sequences: n <= sink + heavy + window selects every token [0, n). When
    init_offset <= sink this is what the general rule gives anyway; when init_offset > sink it also
    keeps the unquantized tokens [sink, init_offset) of such short sequences.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from pqattn.reference.pq import exact_scores, group_pq_scores, pq_scores


class Selection(NamedTuple):
    positions: torch.Tensor  # [B, H, L] int32, -1 past counts
    counts: torch.Tensor  # [B, H] int32


def selection_width(sink: int, window: int, heavy: int, short_threshold: int | None = None) -> int:
    """L, the list width: sink + heavy + window, widened if a short-sequence rule keeps more tokens."""
    base = sink + heavy + window
    return base if short_threshold is None else max(base, short_threshold)


class SelectParams(NamedTuple):
    """What a selection keeps of a row of n tokens (SPEC §2): sink [0, sink), window [n - window, n)
    and the `heavy` best candidates in [cand_lo, n - window); a row with n <= short_threshold keeps
    every token. width: L, the width of its positions."""

    sink: int
    window: int
    heavy: int
    cand_lo: int
    short_threshold: int
    width: int

    @classmethod
    def make(
        cls, *, sink: int, window: int, heavy: int, cand_lo: int, short_threshold: int, n_tokens: int
    ) -> SelectParams:
        """The params of rows over a token axis of n_tokens (the width covers the short rule)."""
        width = selection_width(sink, window, heavy, min(short_threshold, n_tokens))
        return cls(sink, window, heavy, cand_lo, short_threshold, width)


def select_from_scores(
    scores: torch.Tensor,
    lengths: torch.Tensor,
    *,
    sink: int,
    window: int,
    heavy: int,
    init_offset: int = 0,
    short_threshold: int | None = None,
    allowed: torch.Tensor | None = None,
) -> Selection:
    """Top-`heavy` candidates by score plus sink and window, per (b, h).

    scores: [B, H, N] (any float dtype; only the order matters), lengths: [B] token counts.
    short_threshold: sequences with n <= short_threshold select all their tokens; None means the
    native rule sink + heavy + window. allowed: [B, H, N] bool, a further bound on the heavy
    candidates (a re-rank's shortlist).
    """
    B, H, N = scores.shape
    dev = scores.device
    threshold = sink + heavy + window if short_threshold is None else short_threshold
    width = selection_width(sink, window, heavy, min(threshold, N))
    n = lengths.to(device=dev, dtype=torch.int64)[:, None, None]  # [B, 1, 1]
    pos = torch.arange(N, device=dev)

    cand = (pos >= max(init_offset, sink)) & (pos < n - window)  # [B, 1, N]
    cand = cand.expand(B, H, N) if allowed is None else cand & allowed
    k = min(heavy, N)
    top = scores.masked_fill(~cand, float("-inf")).topk(k, dim=-1, sorted=True).indices
    top_ok = cand.gather(-1, top)

    sink_pos = torch.arange(sink, device=dev).expand(B, H, sink)
    win_start = torch.maximum(n - window, n.clamp(max=sink))
    win_pos = win_start + torch.arange(window, device=dev)
    parts = torch.cat([sink_pos, top, win_pos.expand(B, H, window)], dim=-1)
    ok = torch.cat([sink_pos < n, top_ok, (win_pos < n).expand(B, H, window)], dim=-1)

    all_pos = torch.arange(width, device=dev).expand(B, H, width)
    pad = width - parts.shape[-1]
    parts = torch.nn.functional.pad(parts, (0, pad), value=-1)
    ok = torch.nn.functional.pad(ok, (0, pad), value=False)
    short = n <= threshold
    parts = torch.where(short, all_pos, parts)
    ok = torch.where(short, all_pos < n, ok)

    order = (~ok).to(torch.int8).argsort(dim=-1, stable=True)
    positions = parts.gather(-1, order)
    counts = ok.sum(-1)
    positions = torch.where(torch.arange(width, device=dev) < counts[..., None], positions, -1)
    return Selection(positions.to(torch.int32), counts.to(torch.int32))


SHARES = ("head", "group")
GROUP_RULES = ("sum", "max")


def group_scores(scores: torch.Tensor, num_kv_heads: int, rule: str) -> torch.Tensor:
    """A group's token scores [B, Hkv, N] from its G = H / Hkv heads' scores [B, H, N] (SPEC §7):
    their sum ("sum") or their max ("max"). The group's PQ scores, whose LUT entries are rounded,
    are `group_pq_scores`."""
    B, H, N = scores.shape
    per_group = scores.reshape(B, num_kv_heads, H // num_kv_heads, N)
    if rule == "sum":
        return per_group.sum(2)
    if rule == "max":
        return per_group.amax(2)
    raise ValueError(f"group_rule: expected one of {GROUP_RULES}, got {rule!r}")


def _shared(scores: torch.Tensor, num_kv_heads: int, share: str, rule: str) -> torch.Tensor:
    if share == "head":
        return scores
    if share == "group":
        return group_scores(scores, num_kv_heads, rule)
    raise ValueError(f"share: expected one of {SHARES}, got {share!r}")


def select_pq(
    q: torch.Tensor,
    centroids: torch.Tensor,
    codes: torch.Tensor,
    lengths: torch.Tensor,
    *,
    sink: int,
    window: int,
    heavy: int,
    init_offset: int = 0,
    short_threshold: int | None = None,
    share: str = "head",
    group_rule: str = "sum",
    rerank: int = 0,
    keys: torch.Tensor | None = None,
) -> Selection:
    """PQ top-k selection (SPEC §2, §7): q [B, H, D], centroids [B, Hkv, M, C, dsub(+1)], codes
    [B, Hkv, N, M]; positions [B, H, L] per head, or [B, Hkv, L] with share="group" (one set per
    KV head by the group scores of `group_rule`, heavy = the group budget). rerank=R >= 1: the top
    R * heavy candidates by PQ score, then the top `heavy` of those by the exact score <q, k> from
    keys [B, Hkv, N, D] (reduced over the group alike)."""
    Hkv = codes.shape[1]
    if share == "group":
        scores = group_pq_scores(q, centroids, codes, group_rule)
    else:
        scores = _shared(pq_scores(q, centroids, codes), Hkv, share, group_rule)
    sizes = dict(sink=sink, window=window, init_offset=init_offset, short_threshold=short_threshold)
    if rerank == 0:
        return select_from_scores(scores, lengths, heavy=heavy, **sizes)
    if keys is None:
        raise ValueError("keys: expected the key cache [B, Hkv, N, D] with rerank >= 1, got None")
    shortlist = select_from_scores(scores, lengths, heavy=rerank * heavy, **sizes)
    allowed = dense_weights(shortlist, scores.shape[-1], torch.float32) > 0
    exact = _shared(exact_scores(q, keys), Hkv, share, group_rule)
    return select_from_scores(exact, lengths, heavy=heavy, allowed=allowed, **sizes)


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
) -> Selection:
    """Exact top-k by <q, k> over the same candidates as PQ: q [B, H, D], keys [B, Hkv, N, D]
    (share="group": one set per KV head by the group scores, as `select_pq`)."""
    scores = _shared(exact_scores(q, keys), keys.shape[1], share, group_rule)
    return select_from_scores(scores, lengths, sink=sink, window=window, heavy=heavy, init_offset=init_offset)


def page_bounds(keys: torch.Tensor, lengths: torch.Tensor, page: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-channel minima and maxima of each page of `page` consecutive tokens (Quest's metadata).

    keys [B, Hkv, N, D], lengths [B] -> (kmin, kmax), each [B, Hkv, ceil(N / page), D] in float32
    (float64 keys stay float64), over the tokens of the page below lengths[b]; a page with none
    gets +inf / -inf.
    """
    B, Hkv, N, D = keys.shape
    pages = -(-N // page)
    dt = torch.float64 if keys.dtype == torch.float64 else torch.float32
    k = torch.nn.functional.pad(keys.to(dt), (0, 0, 0, pages * page - N))
    live = torch.arange(pages * page, device=keys.device) < lengths.to(keys.device)[:, None]  # [B, P*page]
    live = live[:, None, :, None]
    kmin = k.masked_fill(~live, float("inf")).reshape(B, Hkv, pages, page, D).amin(3)
    kmax = k.masked_fill(~live, float("-inf")).reshape(B, Hkv, pages, page, D).amax(3)
    return kmin, kmax


def page_scores(
    q: torch.Tensor, kmin: torch.Tensor, kmax: torch.Tensor, page: int, n_tokens: int
) -> torch.Tensor:
    """Each token's score is its page's upper bound on <q, k>: sum_d max(q_d * kmin_d, q_d * kmax_d).

    q [B, H, D] (or [B, H, R, D] for R query rows), kmin/kmax [B, Hkv, pages, D] -> [B, H, n_tokens]
    (or [B, H, R, n_tokens]). Pages with no token score -inf.
    """
    rows = q.dim() == 4
    qr = q if rows else q[:, :, None]
    B, H, R, D = qr.shape
    Hkv = kmin.shape[1]
    qg = qr.to(kmin.dtype).reshape(B, Hkv, H // Hkv, R, D)
    pos, neg = qg.clamp(min=0), qg.clamp(max=0)
    # an empty page has kmax = -inf and kmin = +inf: its bound is -inf whatever the query's signs
    empty = torch.isinf(kmax).all(-1)[:, :, None, None]  # [B, Hkv, 1, 1, pages]
    kmax_f = torch.nan_to_num(kmax, neginf=0.0)
    kmin_f = torch.nan_to_num(kmin, posinf=0.0)
    bound = torch.einsum("bkgrd,bkpd->bkgrp", pos, kmax_f) + torch.einsum("bkgrd,bkpd->bkgrp", neg, kmin_f)
    bound = bound.masked_fill(empty, float("-inf"))
    scores = bound.repeat_interleave(page, dim=-1)[..., :n_tokens].reshape(B, H, R, n_tokens)
    return scores if rows else scores[:, :, 0]


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
    """Quest-style page selection (SPEC §7): pages of `page` tokens ranked by their bound on <q, k>,
    taken in that order until `heavy` candidate tokens are covered (the last page partly, ties
    any), plus sink and window; the same candidates and short-sequence rule as `select_pq`.

    q [B, H, D], keys [B, Hkv, N, D], lengths [B]. Every candidate token of a page carries the
    page's bound as its score, so the top-`heavy` candidates by score are whole pages in bound
    order.
    """
    kmin, kmax = page_bounds(keys, lengths, page)
    scores = page_scores(q, kmin, kmax, page, keys.shape[2])
    return select_from_scores(scores, lengths, sink=sink, window=window, heavy=heavy, init_offset=init_offset)


def select_streaming(lengths: torch.Tensor, num_heads: int, *, sink: int, window: int) -> Selection:
    """Sink + window only (StreamingLLM): the same for every head. lengths [B] -> [B, H, sink + window]."""
    B = lengths.shape[0]
    n_max = sink + window
    scores = torch.zeros((B, num_heads, n_max), device=lengths.device)
    # Positions only depend on n, never on scores, so a narrow score row is enough when n > sink + window:
    # rebase the window onto the last `window` slots of that row.
    sel = select_from_scores(scores, lengths.clamp(max=n_max), sink=sink, window=window, heavy=0)
    shift = (lengths - lengths.clamp(max=n_max))[:, None, None].to(torch.int32)
    positions = torch.where(sel.positions >= sink, sel.positions + shift, sel.positions)
    return Selection(positions, sel.counts)


def dense_weights(selection: Selection, n_tokens: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Per-token weights [B, H, n_tokens]: 1 for selected positions, 0 elsewhere."""
    positions, counts = selection
    B, H, L = positions.shape
    ok = torch.arange(L, device=positions.device) < counts[..., None]
    w = torch.zeros((B, H, n_tokens + 1), dtype=dtype, device=positions.device)
    slot = torch.where(ok, positions.long(), n_tokens)  # padding lands in a spare column
    w.scatter_(-1, slot, 1.0)
    return w[..., :n_tokens]


def bad_selection_rows(positions: torch.Tensor, counts: torch.Tensor, n_tokens: int) -> torch.Tensor:
    """The rows breaking the list rules (SPEC §3): counts [B, R] outside [0, L], or one of the
    first counts[b, r] positions [B, R, L] outside [0, n_tokens). bool [B * R]."""
    L = positions.shape[-1]
    live = torch.arange(L, device=positions.device) < counts[..., None]
    out_of_range = (positions < 0) | (positions >= n_tokens)
    bad = (counts < 0) | (counts > L) | (live & out_of_range).any(-1)
    return bad.reshape(-1)


def code_combinations(codes: torch.Tensor, C: int) -> torch.Tensor:
    """Each token's code combination sum_m codes[..., m] * C**(M-1-m): codes [..., M] -> [...] int64."""
    combo = torch.zeros(codes.shape[:-1], dtype=torch.long, device=codes.device)
    for m in range(codes.shape[-1]):
        combo = combo * C + codes[..., m].long()
    return combo


def bucket_candidates(
    codes: torch.Tensor, lengths: torch.Tensor, *, C: int, window: int, cand_lo: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The candidate tokens [cand_lo, lengths[b] - window) grouped by code combination (the
    buckets of a PQ index, pqattn.kernels.select.buckets): codes [B, Hkv, N, M] ->
    order [B, Hkv, N] int64 (the candidates' positions by combination, then by position; -1 after
    them) and starts [B, Hkv, C**M + 1] int64 (where each combination's run begins)."""
    B, Hkv, N, M = codes.shape
    P = C**M
    pos = torch.arange(N, device=codes.device)
    cand = (pos >= cand_lo) & (pos < lengths.long()[:, None] - window)  # [B, N]
    combo = torch.where(cand[:, None, :], code_combinations(codes, C), P)  # P: not a candidate
    key, idx = torch.sort(combo * N + pos, dim=-1)
    order = torch.where(key < P * N, idx, -1)
    counts = torch.zeros(B, Hkv, P + 1, dtype=torch.long, device=codes.device)
    counts.scatter_add_(2, combo, torch.ones_like(combo))
    starts = torch.cat([torch.zeros_like(counts[..., :1]), counts[..., :P].cumsum(-1)], dim=-1)
    return order, starts
