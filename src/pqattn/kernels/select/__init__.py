"""The PQ top-k selection kernels (SPEC §2), one family in four routes (`pqattn.policy.ROUTES`):

- `fine`: every token's score from its fine codes in many programs per row, binned, then the
  tokens above the need-th score's bin collected and that bin finished exactly (every group
  selection and re-rank; per-head selections beyond the tree);
- `tree`: every code read, a row split into leaves that pass on their top-k, merged by a tree
  inside one launch (more than MAX_COMBOS code combinations; heavy <= MAX_TREE_HEAVY);
- `hist`: at most MAX_COMBOS combinations: a weighted search for the cut over the combinations'
  scores, then one pass over the codes (no buckets kept);
- `buckets`: the same cut, then about `heavy` positions copied from the index's inverted lists
  (PQIndex keeps them), optionally encoding the step's new key in the same launch (`NewKey`).

The fine route's first launch can likewise encode a decode step's new key (`AppendedKey`).

`common` holds the device helpers they share. `pqattn.policy.select_route` picks the route and
`pqattn.dispatch` launches it; the decisions
and their figures are in docs/kernels/select.md. Importing this package compiles nothing: the
kernels are decorated when their modules are imported, by the dispatch layer.
"""

from __future__ import annotations

from typing import NamedTuple

import torch


class NewKey(NamedTuple):
    """One new key per (sequence, KV head) that the bucket selection encodes before it selects,
    doing the encode launch's work (pqattn.kernels.encode with T = 1) in the same launch: keys
    [B, Hkv, 1, D] (last dim contiguous) written at row `length` - 1 over the last n_drop rows
    of sequences `length` - 1 + n_drop tokens long (every sequence: the original's entry point
    has one N), the histogram kept, and the lengths set to `length`. The length is a launch
    argument rather than read from the device: no program's work waits for that load, and
    nothing needs to know when every program has read it. phi [B, Hkv, M] (contiguous) for the
    ip metric, else None. Needs n_drop < window (the new key is in the window: the selection
    does not read its code) and n_drop <= 2 (at most one position changes candidacy). Under GQA
    the G query rows of a KV head each encode its key (the same codes, stored by each) and
    apply the histogram's change to their own copy; the last of them to have read the histogram
    writes the change back (an arrival counter in the workspace)."""

    keys: torch.Tensor
    phi: torch.Tensor | None
    length: int
    n_drop: int


class AppendedKey(NamedTuple):
    """One new key per (sequence, KV head) that the fine route's LUT launch encodes, doing the
    encode launch's work (pqattn.kernels.encode with T = 1, no histogram) from the centroid loads
    its tables take: keys [B, Hkv, 1, D] (last dim contiguous) coded at row lengths[b] of the
    codes (code_base 0), and lengths[b] advanced by one in the same launch. arrivals: int32 [B],
    zero-filled once (left at zero): the launch's last program of a sequence advances its length.
    phi [B, Hkv, M] (contiguous) for the ip metric, else None. kv_cache: (k_cache, v_cache,
    values) to store the key and values [B, Hkv, 1, D] (last dim contiguous) at that row of the
    caches [B, Hkv, >= capacity, D], or None. at_length: keys is instead a key cache
    [B, Hkv, >= capacity, D] (last dim contiguous) whose row lengths[b] already holds the new key
    (a cache the caller wrote first, as transformers' static cache is). The new key is in the
    window (window >= 1): the selection does not read its code."""

    keys: torch.Tensor
    phi: torch.Tensor | None
    arrivals: torch.Tensor
    kv_cache: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None
    at_length: bool = False
