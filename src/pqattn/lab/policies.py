"""Selection policies compared by the quality lab, each at a density of the cache.

A `Policy` names what picks the heavy tokens beyond sink and window (SPEC §2, §7): the exact
top-k oracle, streaming (no heavy part: the budget widens the window), PQ top-k at a code
resolution (M sub-vectors, bits), or Quest-style pages. `select` runs one on a cache through
`pqattn.ops` (the kernels where they exist); `pqattn.lab.tasks` runs them inside a model.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch

from pqattn import ops
from pqattn.reference import Selection

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

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"kind: expected one of {KINDS}, got {self.kind!r}")
        if self.kind != "dense" and not 0.0 < self.density <= 1.0:
            raise ValueError(f"density: expected a value in (0, 1], got {self.density}")

    @property
    def family(self) -> str:
        """The policy without its density: dense, oracle, streaming, pq-M2-b6, pages-16."""
        if self.kind == "pq":
            return f"pq-M{self.subvectors}-b{self.bits}"
        if self.kind == "pages":
            return f"pages-{self.page}"
        return self.kind

    @property
    def name(self) -> str:
        return self.family if self.kind == "dense" else f"{self.family}@{self.density:g}"

    def heavy(self, n_tokens: int) -> int:
        return max(1, round(self.density * n_tokens))


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
    (`book`: the PQ codebook of the keys at the policy's M and bits; init_offset = sink); heavy =
    round(density * n_tokens)."""
    heavy = policy.heavy(n_tokens)
    if policy.kind == "streaming":
        return ops.select_streaming(lengths, q.shape[1], sink=sink, window=window + heavy)
    if policy.kind == "oracle":
        return ops.select_oracle(q, keys, lengths, sink=sink, window=window, heavy=heavy, init_offset=sink)
    if policy.kind == "pages":
        return ops.select_pages(
            q, keys, lengths, sink=sink, window=window, heavy=heavy, page=policy.page, init_offset=sink
        )
    if policy.kind == "pq":
        if book is None:
            raise ValueError(f"book: the {policy.family} policy needs the keys' PQ codebook, got None")
        return ops.select_topk(
            q, book.centroids, book.codes, lengths, sink=sink, window=window, heavy=heavy, init_offset=sink
        )
    raise ValueError(f"policy: expected a non-dense policy, got {policy.name}")
