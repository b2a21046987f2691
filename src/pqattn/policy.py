"""The selection policy: which tokens a decode query keeps (SPEC §2, §7), in one type.

`SelectPolicy` holds what every API that selects shares: the sizes (sink, window, and heavy in
tokens per query head, one meaning everywhere), whether a KV head's G query heads share one
selection and by which group rule, the group's budget, and the exact re-rank. It derives what the
callers need from it: the rows a selection keeps (`row_heavy`), the list width, the selection
rows per sequence, the lookup tables a row scores with, and the kernel route (`route`).
`PQConfig` (the index) and `HFConfig` (the transformers integration) extend it; the functional
API takes one.

The routes (pqattn.kernels.select; docs/kernels/select.md):
- "fine": every token's score from its fine codes, then an exact top-k by a histogram of the
  scores: every group selection and re-rank, and per-head selections of more than MAX_COMBOS
  code combinations and heavy > MAX_TREE_HEAVY.
- "buckets": an index that keeps its candidates grouped by code combination (PQIndex on a GPU,
  at most MAX_COMBOS combinations) reads about `heavy` positions a row.
- "hist": a histogram of the combinations' counts, C**M <= MAX_COMBOS (kept by the caller, or
  counted per call when heavy > STATELESS_TREE_MAX_HEAVY).
- "tree": a merge tree of per-tile top-k lists, heavy <= MAX_TREE_HEAVY.
"""

from __future__ import annotations

import dataclasses
import warnings

from pqattn import _validate as check
from pqattn.limits import MAX_COMBOS, MAX_TREE_HEAVY, STATELESS_TREE_MAX_HEAVY

ROUTES = ("fine", "buckets", "hist", "tree")


@dataclasses.dataclass(frozen=True)
class SelectPolicy:
    """Which tokens a decode query keeps: `sink` first and `window` last tokens always, and
    `heavy` more per query head chosen by PQ score (SPEC §2).

    share="head" selects per query head; share="group" one selection per KV head for its G query
    heads, by the group score of `group_rule` ("max" or "sum" of the heads' PQ scores, SPEC §7),
    keeping group_budget x heavy tokens (None: G x heavy, as many rows as the heads would keep one
    by one). rerank=R >= 1 takes the top by exact <q, k> among R times as many by PQ score (the
    selection then reads the key cache). The defaults are the operating point the quality harness
    measured best (docs/kernels/select.md, "The defaults")."""

    sink: int = 128
    window: int = 128
    heavy: int = 128
    share: str = "group"
    group_rule: str = "max"
    group_budget: float | None = None
    rerank: int = 0

    def __post_init__(self) -> None:
        for name in ("sink", "window", "heavy"):
            check.non_negative_int(name, getattr(self, name))
        check.share_options(self.share, self.group_rule, self.rerank, self.group_budget)

    @property
    def policy(self) -> SelectPolicy:
        """The selection policy alone (a config that extends it gives its own fields)."""
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(SelectPolicy)}
        return SelectPolicy(**fields)

    def rows(self, heads: int, kv_heads: int) -> int:
        """Selection rows per sequence: a row per query head, or per KV head for a group."""
        return kv_heads if self.share == "group" else heads

    def row_heavy(self, group: int) -> int:
        """The heavy tokens one selection row keeps for `group` query heads per KV head: heavy
        per query head, or group_budget x heavy (G x heavy when None) for a KV head's group."""
        return row_heavy(self.heavy, self.share, self.group_budget, group)

    def width(self, group: int = 1) -> int:
        """L, the selection list width for `group` query heads per KV head: sink + row_heavy + window."""
        return self.sink + self.row_heavy(group) + self.window

    def tables(self, group: int) -> int:
        """Lookup tables a selection row scores with: one per head of a group under the max
        rule (the max of their scores), else one (the sum rule's is linear in the query)."""
        return lookup_tables(self.share, self.group_rule, group)

    def route(
        self, M: int, C: int, group: int, *, kept_histogram: bool = False, buckets: bool = False
    ) -> str:
        """The selection kernel (one of ROUTES) for codes of M sub-vectors of C centroids and
        `group` query heads per KV head; `kept_histogram` / `buckets`: what the caller keeps of
        the candidates (PQIndex on a GPU)."""
        return select_route(
            M,
            C,
            self.row_heavy(group),
            share=self.share,
            rerank=self.rerank,
            kept_histogram=kept_histogram,
            buckets=buckets,
        )


def select_route(
    M: int,
    C: int,
    row_heavy: int,
    *,
    share: str = "head",
    rerank: int = 0,
    kept_histogram: bool = False,
    buckets: bool = False,
) -> str:
    """The selection kernel (one of ROUTES) for a row keeping `row_heavy` tokens by codes of M
    sub-vectors of C centroids (the module's docstring says what serves which case). The route
    "tree" serves row_heavy <= MAX_TREE_HEAVY only: past it a call runs the reference."""
    if buckets:
        return "buckets"
    if share == "group" or rerank > 0 or (C**M > MAX_COMBOS and row_heavy > MAX_TREE_HEAVY):
        return "fine"
    if C**M <= MAX_COMBOS and (kept_histogram or row_heavy > STATELESS_TREE_MAX_HEAVY):
        return "hist"
    return "tree"


def row_heavy(heavy: int, share: str, group_budget: float | None, group: int) -> int:
    """The heavy tokens a selection row keeps (`SelectPolicy.row_heavy`): heavy per query head,
    or group_budget x heavy (G x heavy when None) for a KV head's group of `group` heads."""
    check.positive_int("group", group)
    if share == "head" or heavy == 0:
        return heavy
    budget = group if group_budget is None else group_budget
    return max(1, round(budget * heavy))


def clamp_row_heavy(row_heavy: int, n_tokens: int, stacklevel: int = 3) -> int:
    """A row's heavy, at most n_tokens: a row of n <= n_tokens tokens keeps every token either way
    (the short-sequence rule), so only the list's padding shrinks; says so (a warning) when it
    clamps, rather than allocate lists of `row_heavy` entries."""
    if row_heavy <= n_tokens:
        return row_heavy
    warnings.warn(
        f"heavy: a row keeps {row_heavy} heavy tokens, more than the {n_tokens} of the token axis: "
        f"every row keeps all its tokens, and the list width uses {n_tokens} instead",
        stacklevel=stacklevel,
    )
    return n_tokens


def lookup_tables(share: str, group_rule: str, group: int) -> int:
    """Lookup tables a selection row scores with (`SelectPolicy.tables`)."""
    return group if share == "group" and group_rule == "max" else 1


PER_HEAD = SelectPolicy(share="head", group_rule="sum")
