"""Hugging Face transformers integration: dense prefill, then PQ sparse decoding, per layer.

    import pqattn.integrations.hf as pq_hf
    pq_hf.enable(model, pq_hf.HFConfig(heavy=1024, sink=128, window=128))
    model.generate(input_ids, max_new_tokens=256)

`enable` registers the attention implementation "pqattn" with transformers and switches the
model to it. Any call with more than one query token (prefill) runs SDPA over the cache and then
(re)builds that layer's `PQIndex` from the cached keys; a call with one query token (a decode
step) appends the new key to the index, selects sink + heavy + window tokens per query head and
runs the sparse decode kernel over the cache (`pqattn.ops.sparse_decode`). Layers listed in
`dense_layers` always use SDPA. The KV cache stays transformers' own (DynamicCache, or a
StaticCache, whose preallocated keys the index then reads up to each sequence's length: the
new token's slot comes from `position_ids`); the index lives on each attention module.
`generate` is the static decode loop: a StaticCache, a dense prefill, then greedy decode steps
of the whole model captured as one CUDA graph and replayed.

Explicitly routed to SDPA (documented, not approximated): a padding mask during decode (the
index does not know padded positions), layers without `layer_idx`, and decode steps past the
index's capacity (prompt + `HFConfig.capacity` tokens; warned once).
"""

from __future__ import annotations

import dataclasses
import warnings

import torch

from pqattn import _validate as check
from pqattn import ops
from pqattn.index import PQConfig, PQIndex

NAME = "pqattn"


@dataclasses.dataclass(frozen=True)
class HFConfig:
    """What `enable` applies to every attention layer.

    heavy: tokens chosen by the PQ scores, or heavy_fraction of the prompt length (at most one
    of the two; 1024 tokens when neither is given);
    sink / window: always kept; subvectors (M), bits, metric, iters, sample: the index (SPEC §1,
    `PQConfig`); share / group_rule / rerank: per-head or group (GQA-shared) selection and the
    exact re-rank of a PQ shortlist (SPEC §7, `PQConfig`; with share="group", heavy is the budget
    of each KV head);
    dense_layers: layer indices that never go sparse; capacity: decode tokens the index has room
    for after the prompt; prefill: "sdpa" (PyTorch's SDPA) or "pqattn" (`pqattn.dense_attention`:
    the Triton flash kernel for CUDA fp16/bf16, the reference elsewhere). Prompts with padding,
    and prompts longer than a sliding window, prefill through SDPA, which applies their mask.
    """

    heavy: int | None = None
    heavy_fraction: float | None = None
    sink: int = 128
    window: int = 128
    subvectors: int = 2
    bits: int = 6
    metric: str = "euclidean"
    iters: int = 10
    sample: int = 0
    share: str = "head"
    group_rule: str = "sum"
    rerank: int = 0
    dense_layers: tuple[int, ...] = ()
    capacity: int = 4096
    prefill: str = "sdpa"

    def __post_init__(self) -> None:
        if self.heavy is not None:
            check.positive_int("heavy", self.heavy)
        for name in ("sink", "window", "iters"):
            check.non_negative_int(name, getattr(self, name))
        check.positive_int("subvectors", self.subvectors)
        check.bits(self.bits)
        check.metric(self.metric)
        check.positive_int("capacity", self.capacity)
        check.non_negative_int("sample", self.sample)
        if self.sample and self.metric != "euclidean":
            raise ValueError(
                f"sample: the {self.metric!r} metric builds on every key, got sample={self.sample}"
            )
        check.share_options(self.share, self.group_rule, self.rerank)
        if not all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in self.dense_layers):
            raise ValueError(f"dense_layers: expected non-negative layer indices, got {self.dense_layers!r}")
        if self.prefill not in PREFILL:
            raise ValueError(f"prefill: expected one of {PREFILL}, got {self.prefill!r}")
        if self.heavy is not None and self.heavy_fraction is not None:
            raise ValueError(
                f"heavy / heavy_fraction: expected at most one of them, got heavy={self.heavy}, "
                f"heavy_fraction={self.heavy_fraction}"
            )
        if self.heavy_fraction is not None and not 0.0 < self.heavy_fraction <= 1.0:
            raise ValueError(f"heavy_fraction: expected a value in (0, 1], got {self.heavy_fraction}")

    def heavy_for(self, prompt_len: int) -> int:
        if self.heavy_fraction is not None:
            return max(1, int(self.heavy_fraction * prompt_len))
        return 1024 if self.heavy is None else self.heavy


PREFILL = ("sdpa", "pqattn")


@dataclasses.dataclass
class _LayerState:
    config: HFConfig
    index: PQIndex | None = None
    padded: bool = False  # the prompt had padding: decode stays dense
    static: bool = False  # the cache is preallocated (StaticCache): keys past the lengths are unused
    # shared by the model's layers: whether decoding past the capacity has been warned about
    warned: dict[str, bool] = dataclasses.field(default_factory=dict)
    sparse_steps: int = 0  # decode calls served sparsely (for tests and stats)


def _sdpa(module, query, key, value, attention_mask, scaling, **kwargs):
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, **kwargs)


def pq_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """The registered attention function: query [B, H, q_len, D], key/value [B, Hkv, S, D] (the
    whole cache after this step's update). Returns ([B, q_len, H, D], None) like SDPA's."""
    state: _LayerState | None = getattr(module, "_pqattn_state", None)
    layer = getattr(module, "layer_idx", None)
    if state is None or layer is None or layer in state.config.dense_layers:
        return _sdpa(module, query, key, value, attention_mask, scaling, **kwargs)
    B, q_len, S = query.shape[0], query.shape[2], key.shape[2]
    position_ids = kwargs.get("position_ids")
    if q_len > 1:  # prefill: dense, then the index of the whole prompt
        c = state.config
        # A preallocated cache is longer than the tokens seen (one host read, at prefill only).
        n = S if position_ids is None else int(position_ids.max()) + 1
        state.static = n < S
        if state.static:
            key, value = key[:, :, :n], value[:, :, :n]
            attention_mask = None if attention_mask is None else attention_mask[..., :n]
        # Padding shows as masked keys in the last prompt row (one host read, at prefill only).
        state.padded = attention_mask is not None and not bool(_last_row_sees_all(attention_mask))
        window = _sliding_window(module)
        plain_causal = getattr(module, "is_causal", True) and (window is None or window >= n)
        if c.prefill == "pqattn" and plain_causal and not state.padded:
            # Without padding, and with no sliding window shorter than the sequence, the mask is
            # the bottom-right causal one.
            attn = ops.dense_attention(query, key, value, causal=True, scale=scaling)
            out = (attn.transpose(1, 2).contiguous(), None)
        else:
            out = _sdpa(module, query, key, value, attention_mask, scaling, **kwargs)
        pq = PQConfig(
            subvectors=c.subvectors,
            bits=c.bits,
            metric=c.metric,
            sink=c.sink,
            window=c.window,
            heavy=c.heavy_for(n),
            iters=c.iters,
            sample=c.sample,
            share=c.share,
            group_rule=c.group_rule,
            rerank=c.rerank,
        )
        state.index = PQIndex.build(key, [n] * B, capacity=S if state.static else S + c.capacity, config=pq)
        return out
    index = state.index
    if index is not None and index.capacity < S and not state.padded and not state.warned.get("capacity"):
        state.warned["capacity"] = True
        warnings.warn(
            f"pqattn: decoding at {S} tokens, past HFConfig.capacity "
            f"(prompt + {state.config.capacity}); its decode steps run dense SDPA from here on. "
            "Raise HFConfig.capacity to keep them sparse.",
            stacklevel=2,
        )
    if index is None or state.padded or index.capacity < S:
        return _sdpa(module, query, key, value, attention_mask, scaling, **kwargs)
    index.append(_new_key(key, position_ids) if state.static else key[:, :, -1:])
    q = query[:, :, 0]
    # the index's output buffer (overwritten by this layer's next step; o_proj reads it before)
    out = index.attend(q, key, value, index.select(q, key), scale=scaling)
    state.sparse_steps += 1
    return out[:, None], None


def _new_key(key: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
    """The decode step's key [B, Hkv, 1, D] from a preallocated cache [B, Hkv, S, D]: the slot of
    each sequence's position (a gather on the device: capturable)."""
    B, Hkv, _, D = key.shape
    at = position_ids[:, -1].expand(B).long()
    return key.gather(2, at.view(B, 1, 1, 1).expand(B, Hkv, 1, D))


def _sliding_window(module: torch.nn.Module) -> int | None:
    window = getattr(module, "sliding_window", None)
    return getattr(getattr(module, "config", None), "sliding_window", None) if window is None else window


def _last_row_sees_all(mask: torch.Tensor) -> torch.Tensor:
    last = mask[..., -1, :]
    return last.all() if last.dtype == torch.bool else (last == 0).all()


def cache_kwargs(model: torch.nn.Module, cache) -> dict:
    """The keyword under which this transformers version's model.forward takes a KV cache:
    {"cache": cache} where forward names it so, else {"past_key_values": cache}."""
    import inspect

    params = inspect.signature(model.forward).parameters
    return {"cache": cache} if "cache" in params else {"past_key_values": cache}


def register() -> None:
    """Register "pqattn" with transformers' attention (and mask) interfaces; idempotent."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

    AttentionInterface.register(NAME, pq_attention_forward)
    ALL_MASK_ATTENTION_FUNCTIONS.register(NAME, sdpa_mask)


def enable(model: torch.nn.Module, config: HFConfig) -> list[int]:
    """Switch a transformers model to PQ sparse decoding.

    Works with any model whose attention modules carry `layer_idx` and call transformers' attention
    interface (Llama, Mistral, Qwen2/3 and their GQA variants).

    Args:
        model: a transformers causal LM. config: what every attention layer applies.

    Returns:
        the layer indices that go sparse (all but `config.dense_layers`).

    Example:
        >>> import transformers
        >>> cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=32,
        ...                                num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
        >>> enable(transformers.LlamaForCausalLM(cfg), HFConfig(heavy=16, sink=4, window=4))
        [0, 1]
    """
    register()
    sparse = []
    warned: dict[str, bool] = {}
    for module in model.modules():
        layer = getattr(module, "layer_idx", None)
        if layer is not None and hasattr(module, "scaling"):
            module._pqattn_state = _LayerState(config, warned=warned)
            if layer not in config.dense_layers:
                sparse.append(layer)
    if not sparse and not config.dense_layers:
        raise ValueError("model: found no attention module with `layer_idx` and `scaling` to switch")
    model.set_attn_implementation(NAME)
    return sorted(set(sparse))


@torch.no_grad()
def generate(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    max_new_tokens: int,
    *,
    eos_token_id: int | None = None,
    capture: bool | None = None,
) -> torch.Tensor:
    """Greedy decoding through a StaticCache: a prefill of the prompts, then one decode step of the
    whole model per token, captured once as a CUDA graph and replayed (no host work per token but
    the replay). Works with pqattn enabled (`enable`) or with any other attention implementation
    (the dense baseline of the same loop).

    Args:
        model: a transformers causal LM whose forward takes `position_ids` (Llama, Mistral, Qwen).
        input_ids: [B, P] int64 prompts of one length, no padding.
        max_new_tokens: tokens to generate per sequence (>= 1).
        eos_token_id: a sequence that emits it emits it again at every later step (as transformers
            pads a finished sequence with it); the batch's graph keeps its shape and runs on.
        capture: replay a CUDA graph of the decode step (default: on a CUDA device); the first
            step runs eagerly (compiles, autotunes, allocates), the graph is captured at the second.

    Returns:
        [B, P + max_new_tokens] int64: the prompts and their greedy continuations.

    Example:
        >>> import transformers
        >>> cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=32,
        ...                                num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2)
        >>> model = transformers.LlamaForCausalLM(cfg).eval()
        >>> generate(model, torch.randint(0, 64, (2, 8)), 4).shape
        torch.Size([2, 12])
    """
    from transformers import StaticCache

    check.tensor("input_ids", input_ids, shape=(None, None), dims="[B, P]", dtypes=(torch.int64,))
    check.positive_int("max_new_tokens", max_new_tokens)
    B, P = input_ids.shape
    dev = input_ids.device
    capture = dev.type == "cuda" if capture is None else capture
    if capture and dev.type != "cuda":
        raise ValueError(f"capture: CUDA graphs need a CUDA device, got input_ids on {dev}")
    cache = StaticCache(config=model.config, max_cache_len=P + max_new_tokens)
    kw = cache_kwargs(model, cache) | {"use_cache": True}
    logits = model(input_ids=input_ids, position_ids=torch.arange(P, device=dev).expand(B, P), **kw).logits
    ids = logits[:, -1:].argmax(-1)  # [B, 1]: the token each decode step reads and overwrites
    eos = None if eos_token_id is None else torch.full_like(ids, eos_token_id)
    done = None if eos is None else ids == eos  # [B, 1]: the sequences that emitted eos
    new = torch.empty(B, max_new_tokens, dtype=torch.int64, device=dev)
    new[:, :1] = ids
    position = torch.full((B, 1), P, dtype=torch.int64, device=dev)
    column = torch.ones(1, dtype=torch.int64, device=dev)  # where the step writes in `new`

    def step() -> None:
        out = model(input_ids=ids, position_ids=position, **kw).logits
        ids.copy_(out[:, -1:].argmax(-1))
        if eos is not None:
            ids.copy_(torch.where(done, eos, ids))
            done.logical_or_(ids == eos)
        new.index_copy_(1, column, ids)
        position.add_(1)
        column.add_(1)

    indexes = [m._pqattn_state for m in model.modules() if getattr(m, "_pqattn_state", None) is not None]
    graph = None
    for t in range(1, max_new_tokens):
        if not capture or t == 1:
            step()
            continue
        if graph is None:
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                step()
        graph.replay()
        if t % PQIndex.REINDEX_AFTER == 0:  # the replays advance the device lengths only
            for state in indexes:
                if state.index is not None:
                    state.index.sync_lengths()
    for state in indexes:
        if state.index is not None and graph is not None:
            state.index.sync_lengths()
    return torch.cat([input_ids, new], dim=1)


def disable(model: torch.nn.Module, implementation: str = "sdpa") -> None:
    """Drop the indexes and go back to `implementation`."""
    for module in model.modules():
        if hasattr(module, "_pqattn_state"):
            del module._pqattn_state
    model.set_attn_implementation(implementation)
