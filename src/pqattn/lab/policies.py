"""Selection policies compared by the quality lab, each at a density of the cache.

A `Policy` names what picks the heavy tokens beyond sink and window (SPEC §2, §7): the exact
top-k oracle, streaming (no heavy part: the budget widens the window), PQ top-k at a code
resolution (M sub-vectors, bits), or Quest-style pages. Its `select` (a
`pqattn.policy.SelectPolicy`) says how: the oracle and PQ may share one selection per KV head
(share="group", by the group score of group_rule, keeping group_budget times the per-head
heavy), and PQ may re-rank a shortlist of rerank times the heavy by the exact scores. The sizes
come from the density (heavy) and the harness's settings (sink, window), not from `select`.
The function `select` runs a policy on a cache through `pqattn.ops` (the kernels where they
exist); `pqattn.lab.tasks` runs them inside a model.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Sequence

import torch

from pqattn import ops
from pqattn.policy import PER_HEAD, SelectPolicy
from pqattn.reference import GROUP_RULES, Selection

PQ_GRID = ((2, 6), (2, 8), (8, 6), (8, 8), (16, 6), (16, 8))
KINDS = ("dense", "oracle", "streaming", "pq", "pages")


@dataclasses.dataclass(frozen=True)
class Policy:
    """A selection policy at a density: heavy = round(density * prefill length) tokens beyond
    sink and window (streaming spends them on a wider window, so every policy keeps as many)."""

    kind: str
    density: float = 0.0
    subvectors: int = 2
    bits: int = 6
    page: int = 16
    select: SelectPolicy = PER_HEAD  # share, group rule, group budget (explicit for a group), re-rank
    sample: int = 0  # the index built on sample * C keys per sequence (0: every key)
    kv8: bool = False  # attention over K and V as the host tier's 8-bit rows give them back

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"kind: expected one of {KINDS}, got {self.kind!r}")
        if self.kind != "dense" and not 0.0 < self.density <= 1.0:
            raise ValueError(f"density: expected a value in (0, 1], got {self.density}")
        if not isinstance(self.select, SelectPolicy):
            raise TypeError(
                f"select: expected a pqattn.policy.SelectPolicy, got {type(self.select).__name__}"
            )
        if self.share == "group" and (self.kind not in ("pq", "oracle") or self.select.group_budget is None):
            raise ValueError(
                "select: a group selection is for pq and oracle policies, with an explicit group_budget, "
                f"got {self.kind!r} with group_budget={self.select.group_budget}"
            )
        if self.kv8 and self.rerank:
            raise ValueError("kv8: the host tier's 8-bit rows do not re-rank (rerank needs the exact keys)")
        if (self.rerank or self.sample) and self.kind != "pq":
            raise ValueError(
                f"rerank / sample: only pq policies re-rank or build on a sample, got {self.kind!r}"
            )

    @property
    def share(self) -> str:
        return self.select.share

    @property
    def group_rule(self) -> str:
        return self.select.group_rule

    @property
    def rerank(self) -> int:
        return self.select.rerank

    @property
    def budget(self) -> float:
        """A group selection's heavy in per-head heavies (1 per head)."""
        return 1.0 if self.share == "head" else self.select.group_budget

    @property
    def family(self) -> str:
        """The policy without its density: dense, oracle, streaming, pq-M2-b6, pages-16, with
        -group-sum-x4 (a group selection of 4 heavies), -rr4 (re-rank of 4 heavies) and -s256 (an
        index built on 256 keys per centroid) and -kv8 (attention over 8-bit keys and values, the
        host tier's `int8` rows)."""
        if self.kind == "pq":
            name = f"pq-M{self.subvectors}-b{self.bits}"
        elif self.kind == "pages":
            name = f"pages-{self.page}"
        else:
            name = self.kind
        if self.share == "group":
            name += f"-group-{self.group_rule}-x{self.budget:g}"
        name += f"-rr{self.rerank}" if self.rerank else ""
        name += f"-s{self.sample}" if self.sample else ""
        return name + ("-kv8" if self.kv8 else "")

    @property
    def name(self) -> str:
        return self.family if self.kind == "dense" else f"{self.family}@{self.density:g}"

    def heavy(self, n_tokens: int) -> int:
        """The per-head heavy at this density."""
        return max(1, round(self.density * n_tokens))

    def selection_heavy(self, n_tokens: int) -> int:
        """The heavy a selection row keeps: the per-head heavy, times the budget for a group."""
        h = self.heavy(n_tokens)
        return max(1, round(self.budget * h)) if self.share == "group" else h


def group_select(rule: str, budget: float, rerank: int = 0) -> SelectPolicy:
    """A lab policy's group selection: by the group score of `rule`, budget per-head heavies."""
    return SelectPolicy(share="group", group_rule=rule, group_budget=budget, rerank=rerank)


def head_select(rerank: int = 0) -> SelectPolicy:
    """A lab policy's per-head selection (with a re-rank of `rerank` heavies)."""
    return SelectPolicy(share="head", group_rule="sum", rerank=rerank)


def yardsticks(policy: Policy) -> dict[str, Policy]:
    """The exact selections a policy is measured against at equal bytes (SPEC §11): "rows", the
    exact top-k by the policy's own group rule at its budget (as many rows per KV head); "tokens",
    the per-head exact top-k at the policy's tokens per query head (a group row serves each of its
    heads). Both are the per-head oracle at the policy's density for a per-head policy."""
    d, budget = policy.density, policy.budget
    rows = Policy("oracle", d)
    if policy.share == "group":
        rows = Policy("oracle", d, select=group_select(policy.group_rule, budget))
    return {"rows": rows, "tokens": Policy("oracle", min(1.0, d * budget))}


_FAMILY = re.compile(
    r"(?P<kind>dense|oracle|streaming|pq-M(?P<m>\d+)-b(?P<b>\d+)|pages-(?P<page>\d+))"
    rf"(?:-group-(?P<rule>{'|'.join(GROUP_RULES)})-x(?P<budget>[0-9.]+))?(?:-rr(?P<rr>\d+))?(?:-s(?P<s>\d+))?"
    r"(?P<kv8>-kv8)?"
)


def from_family(family: str, density: float) -> Policy:
    """The policy that `Policy.family` names (e.g. pq-M32-b4-group-max-x4-rr2) at a density."""
    got = _FAMILY.fullmatch(family)
    if got is None:
        raise ValueError(f"policy: expected a family such as pq-M16-b8-group-max-x4-rr2, got {family!r}")
    kind = got["kind"].split("-")[0]
    fields: dict = {"density": 0.0 if kind == "dense" else density}
    if got["m"]:
        fields |= {"subvectors": int(got["m"]), "bits": int(got["b"])}
    if got["page"]:
        fields["page"] = int(got["page"])
    select = dict(share="head", group_rule="sum")
    if got["rule"]:
        select = dict(share="group", group_rule=got["rule"], group_budget=float(got["budget"]))
    fields["select"] = SelectPolicy(**select, rerank=int(got["rr"] or 0))
    fields["sample"] = int(got["s"] or 0)
    fields["kv8"] = bool(got["kv8"])
    return Policy(kind, **fields)


def policy_grid(
    densities: Sequence[float], pq_configs: Sequence[tuple[int, int]] = PQ_GRID, page: int = 16
) -> list[Policy]:
    """dense, then per density: oracle, streaming, PQ at each (M, bits), pages."""
    out = [Policy("dense")]
    for d in densities:
        out += [Policy("oracle", d), Policy("streaming", d)]
        out += [Policy("pq", d, subvectors=m, bits=b) for m, b in pq_configs]
        out.append(Policy("pages", d, page=page))
    return out


def select(
    policy: Policy,
    q: torch.Tensor,
    keys: torch.Tensor,
    lengths: torch.Tensor,
    *,
    sink: int,
    window: int,
    n_tokens: int,
    book: ops.PQCodebook | None = None,
) -> Selection:
    """The selection of a non-dense `policy` for decode queries q [B, H, D] over keys [B, Hkv, N, D]
    (`book`: the PQ codebook of the keys at the policy's M, bits and sample; init_offset = sink); heavy =
    `policy.selection_heavy(n_tokens)`. Group selections have Hkv rows (`per_head` expands them)."""
    if policy.kv8:
        raise ValueError(
            f"policy: {policy.name} changes the values attended, not the selection (pqattn tasks measures it)"
        )
    heavy = policy.selection_heavy(n_tokens)
    per_head = policy.heavy(n_tokens)  # the functional API's heavy: tokens per query head
    shared = dict(share=policy.share, group_rule=policy.group_rule, group_budget=policy.budget)
    if policy.kind == "streaming":
        return ops.select_streaming(lengths, q.shape[1], sink=sink, window=window + heavy)
    if policy.kind == "oracle":
        return ops.select_oracle(
            q, keys, lengths, sink=sink, window=window, heavy=per_head, init_offset=sink, **shared
        )
    if policy.kind == "pages":
        return ops.select_pages(
            q, keys, lengths, sink=sink, window=window, heavy=heavy, page=policy.page, init_offset=sink
        )
    if policy.kind == "pq":
        if book is None:
            raise ValueError(f"book: the {policy.family} policy needs the keys' PQ codebook, got None")
        return ops.select_topk(
            q,
            book.centroids,
            book.codes,
            lengths,
            sink=sink,
            window=window,
            heavy=per_head,
            init_offset=sink,
            rerank=policy.rerank,
            keys=keys if policy.rerank else None,
            **shared,
        )
    raise ValueError(f"policy: expected a non-dense policy, got {policy.name}")


def per_head(selection: Selection, num_heads: int) -> Selection:
    """A selection with one row per query head: a group selection's rows repeated for its heads."""
    rows = selection.positions.shape[1]
    if rows == num_heads:
        return selection
    g = num_heads // rows
    return Selection(selection.positions.repeat_interleave(g, 1), selection.counts.repeat_interleave(g, 1))
