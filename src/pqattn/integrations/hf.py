"""Hugging Face transformers integration: dense prefill, then PQ sparse decoding, per layer.

    import pqattn.integrations.hf as pq_hf
    pq_hf.enable(model, pq_hf.HFConfig(heavy=1024, sink=128, window=128))
    model.generate(input_ids, max_new_tokens=256)

`enable` registers the attention implementation "pqattn" with transformers and switches the
model to it. Any call with more than one query token (prefill) runs SDPA over the cache and then
(re)builds that layer's `PQIndex` from the cached keys; a call with one query token (a decode
step) appends the new key to the index, selects sink + heavy + window tokens per query head and
runs the sparse decode kernel over the cache (`pqattn.ops.sparse_decode`). Layers listed in
`dense_layers` always use SDPA. The KV cache stays transformers' own (DynamicCache); the index
lives on each attention module.

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
    if q_len > 1:  # prefill: dense, then the index of the whole prompt
        c = state.config
        # Padding shows as masked keys in the last prompt row (one host read, at prefill only).
        state.padded = attention_mask is not None and not bool(_last_row_sees_all(attention_mask))
        window = _sliding_window(module)
        plain_causal = getattr(module, "is_causal", True) and (window is None or window >= S)
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
            heavy=c.heavy_for(S),
            iters=c.iters,
            sample=c.sample,
            share=c.share,
            group_rule=c.group_rule,
            rerank=c.rerank,
        )
        state.index = PQIndex.build(key, [S] * B, capacity=S + c.capacity, config=pq)
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
    index.append(key[:, :, -1:])
    q = query[:, :, 0]
    # the index's output buffer (overwritten by this layer's next step; o_proj reads it before)
    out = index.attend(q, key, value, index.select(q, key), scale=scaling)
    state.sparse_steps += 1
    return out[:, None], None


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


def disable(model: torch.nn.Module, implementation: str = "sdpa") -> None:
    """Drop the indexes and go back to `implementation`."""
    for module in model.modules():
        if hasattr(module, "_pqattn_state"):
            del module._pqattn_state
    model.set_attn_implementation(implementation)
