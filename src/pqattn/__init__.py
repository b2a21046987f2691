"""pqattn: product-quantization sparse attention for long-context LLM decoding.

A PQ index of the keys picks, per decode query, the few hundred or thousand tokens that matter;
attention then runs over those only. `pqattn.ops` holds the functional API, `PQIndex` the
per-layer decode state, `pqattn.reference` the PyTorch semantics every kernel is tested against.
"SPEC §n" in the code is a section of docs/SPEC.md; "the original" is the system pqattn grew
from, the PQCache backend of sparse-attention-hub, whose entry point `indexer_next` pqattn keeps
(SPEC §5, `pqattn.integrations.sparse_attention_hub`).
"""

from pqattn.index import PQConfig, PQIndex, decode_step
from pqattn.ops import (
    PQCodebook,
    build_index,
    dense_attention,
    dense_decode,
    encode_keys,
    paged_append,
    pq_scores,
    select_oracle,
    select_pages,
    select_streaming,
    select_topk,
    selection_weights,
    sparse_decode,
    validate_selection,
)
from pqattn.reference import Selection

__version__ = "0.1.0"

__all__ = [
    "PQCodebook",
    "PQConfig",
    "PQIndex",
    "Selection",
    "__version__",
    "build_index",
    "decode_step",
    "dense_attention",
    "dense_decode",
    "encode_keys",
    "paged_append",
    "pq_scores",
    "select_oracle",
    "select_pages",
    "select_streaming",
    "select_topk",
    "selection_weights",
    "sparse_decode",
    "validate_selection",
]
