"""Pure-PyTorch references: the semantics of docs/SPEC.md in code. Any device, float64-capable.

Kernels are tested against these; the public API in `pqattn.ops` routes here where no kernel
exists for a case.
"""

from pqattn.reference.attention import dense_attention, paged_append, sparse_decode, to_pages, unpage
from pqattn.reference.pq import KMeansResult, build_pq, encode, exact_scores, pq_scores
from pqattn.reference.rows import (
    Misses,
    RowCache,
    decode_rows,
    encode_rows,
    fetch_rows,
    lookup_rows,
    new_row_cache,
    quantize,
)
from pqattn.reference.selection import (
    GROUP_RULES,
    SHARES,
    Selection,
    SelectParams,
    bad_selection_rows,
    bucket_candidates,
    code_combinations,
    dense_weights,
    group_scores,
    page_bounds,
    page_scores,
    select_from_scores,
    select_oracle,
    select_pages,
    select_pq,
    select_streaming,
    selection_width,
)

__all__ = [
    "GROUP_RULES",
    "SHARES",
    "KMeansResult",
    "Misses",
    "RowCache",
    "SelectParams",
    "Selection",
    "bad_selection_rows",
    "bucket_candidates",
    "build_pq",
    "code_combinations",
    "decode_rows",
    "dense_attention",
    "dense_weights",
    "encode",
    "encode_rows",
    "exact_scores",
    "fetch_rows",
    "group_scores",
    "lookup_rows",
    "new_row_cache",
    "page_bounds",
    "page_scores",
    "paged_append",
    "pq_scores",
    "quantize",
    "select_from_scores",
    "select_oracle",
    "select_pages",
    "select_pq",
    "select_streaming",
    "selection_width",
    "sparse_decode",
    "to_pages",
    "unpage",
]
