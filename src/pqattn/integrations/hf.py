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
new token's slot is each sequence's length, its position); the index lives on each attention module.
`generate` is the static decode loop (`StaticDecoder`, one step at a time): a StaticCache, a
dense prefill, then greedy decode steps of the whole model captured as one CUDA graph and
replayed; ragged batches pass right-padded prompts with `prompt_lengths`.

Routed explicitly (documented, not approximated): decode steps of `dense_layers` and decode steps
past the index's capacity (prompt + `HFConfig.capacity` tokens; warned once) attend densely over
every cached token up to the step's position through pqattn's split-K decode kernel
(`split_k_decode`: no mask, the cache read once for a KV head's query heads) on CUDA, through SDPA
elsewhere. A prompt whose visible keys are one run per sequence that ends at the prompt's last
token (left padding, as `generate` pads a batch) is indexed from each sequence's first token on
(index row r of sequence b is cache position starts[b] + r), over a dynamic or a static cache,
and its decode steps select and attend sparsely. Other padded prompts build no index (warned
once): left padding with re-rank, and a sliding window shorter than the prompt (whose mask shows
one run too), decode densely over that run of the step's mask through the same split-K kernel,
any other mask through SDPA with the mask. Layers without `layer_idx` run SDPA.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Sequence

import torch
from transformers import StaticCache
from transformers.cache_utils import StaticLayer

from pqattn import _validate as check
from pqattn import dispatch, ops
from pqattn import host as host_tier
from pqattn import reference as ref
from pqattn.host import HostCache
from pqattn.index import PQConfig, PQIndex
from pqattn.integrations import projections

NAME = "pqattn"


@dataclasses.dataclass(frozen=True)
class HFConfig(PQConfig):
    """What `enable` applies to every attention layer: a `PQConfig` (the index and the selection
    policy, SPEC §1, §2, §7: heavy counts tokens per query head, a group keeps group_budget x
    heavy, G x heavy by default; the defaults are the measured operating point, M=16, 8 bits,
    group max), and:

    heavy_fraction: heavy as this fraction of each prompt's length instead of a fixed count (give
    heavy or heavy_fraction, not both); dense_layers: layer indices that never go sparse;
    capacity: decode tokens the index has room for after the prompt; prefill: "sdpa" (PyTorch's
    SDPA) or "pqattn" (`pqattn.dense_attention`: the Triton flash kernel for CUDA fp16/bf16, the
    reference elsewhere). Prompts with padding, and prompts longer than a sliding window, prefill
    through SDPA, which applies their mask.

    kv_placement: "gpu" (the cache is transformers' own, on the device) or "host" (SPEC §10: each
    layer's keys and values go to host memory as the prefill makes them, and decode steps select
    on the GPU and fetch the selected rows into a row cache of `host_slots` rows per KV head,
    default `pqattn.host.ROW_CACHE_LISTS` list widths, fewer where the GPU's free memory does not
    hold them; `pqattn.host.HostCache`); `host_int8`
    stores the rows with 8 bits per element and a scale per row (half the host bytes; the
    attention reads the dequantized rows). The host tier
    decodes through `generate` / `StaticDecoder`, with one selection per KV head
    (share="group"), no re-rank and no dense_layers.
    """

    heavy_fraction: float | None = None
    dense_layers: tuple[int, ...] = ()
    capacity: int = 4096
    prefill: str = "sdpa"
    kv_placement: str = "gpu"
    host_slots: int | None = None
    host_int8: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        check.positive_int("capacity", self.capacity)
        if not all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in self.dense_layers):
            raise ValueError(f"dense_layers: expected non-negative layer indices, got {self.dense_layers!r}")
        if self.prefill not in PREFILL:
            raise ValueError(f"prefill: expected one of {PREFILL}, got {self.prefill!r}")
        if self.kv_placement not in KV_PLACEMENTS:
            raise ValueError(f"kv_placement: expected one of {KV_PLACEMENTS}, got {self.kv_placement!r}")
        if self.host_slots is not None:
            check.positive_int("host_slots", self.host_slots)
        if self.host_int8 and self.kv_placement != "host":
            raise ValueError(f"host_int8: expected kv_placement='host', got {self.kv_placement!r}")
        if self.kv_placement == "host":
            bad = {
                "share": (self.share, "group"),
                "rerank": (self.rerank, 0),
                "dense_layers": (self.dense_layers, ()),
            }
            for name, (got, want) in bad.items():
                if got != want:
                    raise ValueError(f"{name}: expected {want!r} with kv_placement='host', got {got!r}")
        if self.heavy_fraction is not None:
            if self.heavy != _DEFAULT_HEAVY:
                raise ValueError(
                    f"heavy / heavy_fraction: expected at most one of them, got heavy={self.heavy}, "
                    f"heavy_fraction={self.heavy_fraction}"
                )
            check.real("heavy_fraction", self.heavy_fraction, "a float in (0, 1] or None")
            if not 0.0 < self.heavy_fraction <= 1.0:
                raise ValueError(f"heavy_fraction: expected a value in (0, 1], got {self.heavy_fraction}")

    def heavy_for(self, prompt_len: int) -> int:
        """heavy for a prompt of prompt_len tokens: heavy_fraction of it (at least 1), or heavy."""
        if self.heavy_fraction is not None:
            return max(1, int(self.heavy_fraction * prompt_len))
        return self.heavy

    def index_config(self, prompt_len: int) -> PQConfig:
        """The PQConfig of a layer's index for a prompt of prompt_len tokens."""
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(PQConfig)}
        return PQConfig(**(fields | {"heavy": self.heavy_for(prompt_len)}))


_DEFAULT_HEAVY = next(f.default for f in dataclasses.fields(PQConfig) if f.name == "heavy")
_WORKSPACE_GROWTH = 4096  # tokens: how far ahead of a growing cache `split_k_decode` sizes its workspace


PREFILL = ("sdpa", "pqattn")
KV_PLACEMENTS = ("gpu", "host")


@dataclasses.dataclass
class _LayerState:
    config: HFConfig
    index: PQIndex | None = None
    padded: bool = False  # the prompt had padding: decode is dense unless `starts` is set
    left_padded: bool = False  # the padding masks a run of keys before each sequence's tokens
    # a left-padded prompt indexed sparsely: each sequence's first key [B] int32 (its index rows
    # start there; a step's selection moves by it to the cache's positions)
    starts: torch.Tensor | None = None
    static: bool = False  # the cache is preallocated (StaticCache): keys past the lengths are unused
    # set by StaticDecoder during its prefill: each sequence's prompt length (the index is built
    # at the chunk that reaches the longest)
    prompt_lengths: list[int] | None = None
    # shared by the model's layers: whether decoding past the capacity has been warned about
    warned: dict[str, bool] = dataclasses.field(default_factory=dict)
    # shared by the model's layers: the dense split-K decode's buffers (`split_k_decode`)
    buffers: dict = dataclasses.field(default_factory=dict)
    # kv_placement="host": the layer's cache layer (set by StaticDecoder) and its host tier (built
    # at the end of the prefill)
    host_layer: _HostLayer | None = None
    host: HostCache | None = None
    host_slots: int | None = None  # the row cache's slots (StaticDecoder sets them; None: the default)
    sparse_steps: int = 0  # decode calls served sparsely (for tests and stats)
    split_k_steps: int = 0  # decode calls served by the dense split-K kernel


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
    if state is None or layer is None:
        return _sdpa(module, query, key, value, attention_mask, scaling, **kwargs)
    if state.config.kv_placement == "host":
        return _host_attention(module, state, query, key, value, attention_mask, scaling, **kwargs)
    B, q_len, S = query.shape[0], query.shape[2], key.shape[2]
    position_ids = kwargs.get("position_ids")
    dense_layer = layer in state.config.dense_layers
    if q_len > 1:  # prefill: dense, then the index of the whole prompt
        c = state.config
        n = _filled(attention_mask, position_ids, S)  # a preallocated cache is longer than that
        state.static = n < S
        if state.static:
            key, value = key[:, :, :n], value[:, :, :n]
            attention_mask = None if attention_mask is None else attention_mask[..., :n]
        # Padding shows as masked keys in the last prompt row (host reads, at prefill only).
        state.padded = attention_mask is not None and not bool(_last_row_sees_all(attention_mask))
        state.left_padded = state.padded and bool(_visible_run_ends_last(attention_mask))
        # left padding keeps the index: each sequence's keys from its first on (a sliding window
        # shorter than the prompt also shows one run a sequence: its steps keep the mask's runs)
        state.starts = None
        window = _sliding_window(module)
        sparse_left = state.left_padded and c.rerank == 0 and (window is None or window >= n)
        first = _run_starts(attention_mask, n) if sparse_left else [n]
        sparse_left = sparse_left and max(first) < n  # (a sequence with no token keeps split-K)
        if state.padded and not sparse_left and not dense_layer and not state.warned.get("padded"):
            state.warned["padded"] = True
            route = (
                "attend densely over each sequence's tokens through the split-K kernel"
                if state.left_padded and ops.decode_kernel_path(query[:, :, 0])
                else "run SDPA with the mask"
            )
            warnings.warn(
                f"pqattn: a prompt with padding (its mask is not the causal one): no index is built and "
                f"the decode steps {route}. Left-pad without re-rank, or right-pad ragged prompts and "
                "pass prompt_lengths to pq_hf.generate, to keep them sparse.",
                stacklevel=_caller_level(),
            )
        if dense_layer or (state.padded and not sparse_left):
            state.index = None
            return _sdpa(module, query, key, value, attention_mask, scaling, **kwargs)
        out = _prefill_attention(module, c, query, key, value, attention_mask, scaling, **kwargs)
        if sparse_left:
            _index_left_padded(module, state, key, first, S if state.static else S + c.capacity)
            return out
        lengths = [n] * B if state.prompt_lengths is None else state.prompt_lengths
        if n < max(lengths):  # a chunk of a longer prefill: the index is built at its last chunk
            return out
        pq = c.index_config(n)
        capacity = S if state.static else S + c.capacity
        state.index = PQIndex.build(key, lengths, capacity=capacity, config=pq, **_kv_head_share(module, key))
        return out
    index = state.index
    if state.padded and state.starts is None:
        if not (state.left_padded and attention_mask is not None and ops.decode_kernel_path(query[:, :, 0])):
            return _sdpa(module, query, key, value, attention_mask, scaling, **kwargs)
        state.split_k_steps += 1
        return split_k_decode(
            query, key, value, None, scaling, state.buffers, attention_mask=attention_mask
        ), None
    if index is not None and index.capacity < S and not state.warned.get("capacity"):
        state.warned["capacity"] = True
        warnings.warn(
            f"pqattn: decoding at {S} tokens, past HFConfig.capacity "
            f"(prompt + {state.config.capacity}); its decode steps attend densely from here on. "
            "Raise HFConfig.capacity to keep them sparse.",
            stacklevel=_caller_level(),
        )
    if index is None or index.capacity < S:
        if not ops.decode_kernel_path(query[:, :, 0]):
            return _sdpa(module, query, key, value, attention_mask, scaling, **kwargs)
        state.split_k_steps += 1
        counts_at = position_ids if state.static else None
        return split_k_decode(query, key, value, counts_at, scaling, state.buffers), None
    q = query[:, :, 0]
    # a static cache holds the new key at the step's position, which is each sequence's length; a
    # dynamic cache's last key is copied out of it, so that the select's inputs keep their strides
    # from step to step and its plan replays
    new_key = key if state.static else key[:, :, -1:].contiguous()
    if state.static and state.starts is not None:  # (left padding: the position counts from starts[b])
        slot = (position_ids[:, -1] + state.starts)[:, None, None, None].expand(
            -1, key.shape[1], 1, key.shape[3]
        )
        new_key = key.gather(2, slot)
    selection = index.select(q, key, append=new_key)
    if state.starts is not None:  # index rows from each sequence's first key: the cache's positions
        # moved in place, within each sequence's run of the cache: attend then trusts the index's
        # own selection (no host read of its values), and the next select rewrites it
        selection.positions.add_(state.starts[:, None, None])
    # the index's output buffer (overwritten by this layer's next step; o_proj reads it before)
    out = index.attend(q, key, value, selection, scale=scaling)
    state.sparse_steps += 1
    return out[:, None], None


def _filled(mask: torch.Tensor | None, position_ids: torch.Tensor | None, S: int) -> int:
    """The cache slots a prefill has filled, of the S its keys hold (one host read, at prefill
    only): up to the last key the last query row sees when there is a mask (a left-padded batch's
    positions stop short of it: each sequence counts from its first token), else up to the largest
    position, else all S."""
    if mask is not None:
        seen = _visible(mask[..., -1, :]).flatten(0, -2).any(dim=0)
        return int(torch.where(seen, torch.arange(seen.shape[0], device=seen.device), -1).max()) + 1
    return S if position_ids is None else int(position_ids.max()) + 1


def _run_starts(mask: torch.Tensor, S: int) -> list[int]:
    """Each sequence's first visible key in the last query row of a left-padded prompt's mask
    [B, 1 or H, q, >= S] (S where none is visible; one host read, at prefill only)."""
    return _first_visible(_visible(mask[..., -1, :S])[:, 0]).tolist()  # (alike for every head)


def _index_left_padded(
    module: torch.nn.Module, state: _LayerState, key: torch.Tensor, first: list[int], capacity: int
) -> None:
    """The index of a left-padded prompt, key [B, Hkv, S, D] its filled slots: sequence b's keys
    from its first visible one, first[b], are its rows 0 .. S - first[b] - 1, and a decode step's
    selection moves to the cache's positions by adding first[b] (`state.starts`)."""
    B, S = key.shape[0], key.shape[2]
    rows = torch.stack([key[b].roll(-first[b], dims=1) for b in range(B)])  # the padding goes last
    lengths = [S - f for f in first]
    c = state.config
    state.index = PQIndex.build(
        rows,
        lengths,
        capacity=capacity,
        config=c.index_config(max(lengths)),
        **_kv_head_share(module, key),
    )
    state.starts = torch.tensor(first, dtype=torch.int32, device=key.device)


def _prefill_attention(
    module: torch.nn.Module,
    config: HFConfig,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """A prompt's dense attention over key/value [B, Hkv, n, D] (a prompt without padding):
    `pqattn.dense_attention` when the config asks for it and no sliding window shorter than the
    sequence makes the mask other than the bottom-right causal one; SDPA with the mask otherwise."""
    window = _sliding_window(module)
    plain_causal = getattr(module, "is_causal", True) and (window is None or window >= key.shape[2])
    if config.prefill == "pqattn" and plain_causal:
        attn = ops.dense_attention(query, key, value, causal=True, scale=scaling)
        return attn.transpose(1, 2).contiguous(), None
    return _sdpa(module, query, key, value, attention_mask, scaling, **kwargs)


def _host_attention(
    module: torch.nn.Module,
    state: _LayerState,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """A layer with its cache in host memory (kv_placement="host"). Prefill: key/value are the
    tokens [0, end) of this chunk's end (the cache layer brought the earlier chunks back); dense
    attention over them, and at the chunk that completes the prompts the layer's index and host
    tier. Decode: key/value are the step's new token; the host tier does the step."""
    layer = state.host_layer
    if layer is None:
        raise ValueError(
            "kv_placement: 'host' keeps the cache in a host tier that pq_hf.generate / StaticDecoder "
            "set up; this call came through another loop (model.generate?): decode with pq_hf.generate"
        )
    if state.prompt_lengths is None:  # a decode step
        out = state.host.decode_step(query[:, :, 0], key, value, scale=scaling)
        state.sparse_steps += 1
        return out[:, None], None
    c, end = state.config, key.shape[2]
    mask = None if attention_mask is None else attention_mask[..., :end]
    out = _prefill_attention(module, c, query, key, value, mask, scaling, **kwargs)
    if end >= max(state.prompt_lengths):
        index = PQIndex.build(
            key, state.prompt_lengths, capacity=layer.max_cache_len, config=c.index_config(end)
        )
        state.host = HostCache(
            index, query_heads=query.shape[1], dtype=key.dtype, slots=state.host_slots, rows=layer.rows,
            int8=c.host_int8,
        )  # fmt: skip
        state.index = index
    return out


def split_k_decode(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    position_ids: torch.Tensor | None,
    scaling: float | None,
    buffers: dict,
    *,
    attention_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Dense decode attention of one query token over every cached token up to its position,
    through `pqattn.ops.dense_decode`'s kernel (split-K flash decoding; each K/V row read once for
    a KV head's G query heads; no mask). The counts and starts it derives lie in the cache, so
    the values are not read on the host (no sync at any step, a growing cache's included).

    Args:
        query: [B, H, 1, D]. key, value: [B, Hkv, S, D] (a static cache: slots past the position
            unused). position_ids: [B, >= 1] the step's positions in a static cache, or None when
            all S tokens are valid. scaling: default 1/sqrt(D). buffers: a dict the caller keeps
            for the launch's buffers (shared by layers of one shape; no allocation after the first
            call for a shape, but one every 4096 tokens of a cache that grows). attention_mask:
            the step's mask [B, 1 or H, 1, S] (boolean, True visible, or additive, 0 visible)
            whose visible keys are one run per sequence (a left-padded prompt and the tokens
            after it), or None; with it, each sequence attends to its run (found on the device;
            position_ids are not read).

    Returns:
        [B, 1, H, D] in query's dtype: a buffer of `buffers`, overwritten by the next call.
    """
    B, H, _, D = query.shape
    Hkv, S = key.shape[1], key.shape[2]
    at = (B, H, Hkv, D, query.dtype, query.device)
    if at not in buffers:
        device = query.device
        buffers[at] = [
            torch.empty(B, dtype=torch.int32, device=device),
            torch.empty(B, H, D, dtype=query.dtype, device=device),
            torch.empty(0, dtype=torch.int32, device=device),
            torch.empty(B, dtype=torch.int32, device=device),
        ]
    counts, out, workspace, starts = buffers[at]
    if workspace.numel() < ops.decode_workspace_numel(B * Hkv, S, D, group=H // Hkv):
        # room for a growing cache (a dynamic one grows a token a step): reallocated every
        # _WORKSPACE_GROWTH tokens, not at every step
        room = -(-S // _WORKSPACE_GROWTH) * _WORKSPACE_GROWTH
        workspace = buffers[at][2] = torch.zeros(
            ops.decode_workspace_numel(B * Hkv, room, D, group=H // Hkv),
            dtype=torch.int32,
            device=query.device,
        )
    if attention_mask is not None:
        visible = _visible(attention_mask[:, 0, -1, :S])  # (a mask may be narrower than the cache)
        slots = torch.arange(1, visible.shape[-1] + 1, device=visible.device, dtype=torch.int32)
        counts.copy_(torch.where(visible, slots, 0).amax(dim=-1))
        starts.copy_(torch.where(visible, slots - 1, S).amin(dim=-1).clamp_max(counts))
    elif position_ids is None:
        counts.fill_(S)
    else:
        counts.copy_(position_ids[:, -1] + 1)
    run = starts if attention_mask is not None else None
    q = query[:, :, 0]
    if ops.decode_kernel_path(q):  # counts and starts lie in the cache by construction: no host read
        dispatch.dense_decode(
            q, key, value, counts, out=out, workspace=workspace, lse=None, scale=scaling, starts=run
        )
    else:
        ops.dense_decode(q, key, value, counts, scale=scaling, out=out, workspace=workspace, starts=run)
    return out[:, None]


def _caller_level() -> int:
    """The stacklevel of a warning raised here that names the first frame outside torch,
    transformers and this module (the user's call)."""
    import inspect

    frame, level = inspect.currentframe(), 0
    skip = ("torch", "transformers", "pqattn", "importlib", "contextlib", "functools")
    while frame is not None:
        name = frame.f_globals.get("__name__", "")
        if level > 1 and name.split(".")[0] not in skip:
            return level
        frame, level = frame.f_back, level + 1
    return 2


def _sliding_window(module: torch.nn.Module) -> int | None:
    window = getattr(module, "sliding_window", None)
    return getattr(getattr(module, "config", None), "sliding_window", None) if window is None else window


def _visible(mask: torch.Tensor) -> torch.Tensor:
    """Which keys a mask (boolean, True visible, or additive, 0 visible) lets attend."""
    return mask if mask.dtype == torch.bool else mask == 0


def _first_visible(visible: torch.Tensor) -> torch.Tensor:
    """The index of each row's first visible key in visible [..., n] (n where there is none)."""
    n = visible.shape[-1]
    return torch.where(visible, torch.arange(n, device=visible.device), n).amin(dim=-1)


def _last_row_sees_all(mask: torch.Tensor) -> torch.Tensor:
    return _visible(mask[..., -1, :]).all()


def _visible_run_ends_last(mask: torch.Tensor) -> torch.Tensor:
    """Whether the last query row of a mask [B, 1 or H, q, n] shows each sequence one run of keys
    that ends at key n - 1, alike for every head (left padding); a 0-dim bool tensor."""
    visible = _visible(mask[..., -1, :])
    n = visible.shape[-1]
    run = visible == (torch.arange(n, device=visible.device) >= _first_visible(visible)[..., None])
    return run.all() & (visible == visible[:, :1]).all()


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

    # (a compiled forward runs it eagerly between its graphs: it keeps host state and launches
    # its own kernels)
    AttentionInterface.register(NAME, torch.compiler.disable(pq_attention_forward))
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
        >>> enable(transformers.LlamaForCausalLM(cfg), HFConfig(heavy=16, sink=4, window=4, subvectors=4))
        [0, 1]
    """
    attention = [
        m for m in model.modules() if getattr(m, "layer_idx", None) is not None and hasattr(m, "scaling")
    ]
    if not attention:
        raise ValueError("model: found no attention module with `layer_idx` and `scaling` to switch")
    layers = {m.layer_idx for m in attention}
    unknown = sorted(set(config.dense_layers) - layers)
    if unknown:
        raise ValueError(
            f"dense_layers: expected layer indices of the model's {len(layers)} attention layers "
            f"(0..{max(layers)}), got {unknown}"
        )
    for m in attention:  # the index splits each key into M sub-vectors
        head_dim = getattr(m, "head_dim", None)
        if isinstance(head_dim, int):
            check.subvectors(config.subvectors, head_dim)
    register()
    warned: dict[str, bool] = {}
    buffers: dict = {}
    for m in attention:
        m._pqattn_state = _LayerState(config, warned=warned, buffers=buffers)
    model.set_attn_implementation(NAME)
    return sorted(layers - set(config.dense_layers))


class StaticDecoder:
    """Greedy decoding of a fixed batch through a preallocated cache, one token per `step()`.

    At construction: a transformers StaticCache for prompt + `max_new_tokens`, the prefill of the
    prompts (in chunks of the sequence when the batch holds more than `prefill_tokens` tokens;
    with pqattn enabled each layer builds its index at the last chunk) and the first new token.
    Each `step()` then runs one decode step of the whole model: the first eagerly (compiles,
    autotunes, allocates), the second captures it as a CUDA graph, every later one replays it (no
    host work per token but the replay). Works with pqattn enabled (`enable`) or with any other
    attention implementation (the dense baseline of the same loop). `compile=True` runs the decode
    step's forward through `torch.compile` (inductor, static shapes): the model's element-wise
    work (norms, rotary embedding, activations, residuals) fuses into few kernels, pqattn's
    attention runs eagerly between the compiled graphs, and the capture then holds fewer, larger
    launches.

    `fuse_projections=True` (the default) runs each layer's q/k/v projections as one GEMM and
    its MLP's gate/up projections as another (`pqattn.integrations.projections.fuse`: the
    model's parameters become views of one buffer a group, at no memory cost) until `close()`,
    which gives them their own storage back (`generate` closes its decoder).

    Ragged batches: `prompt_lengths` gives each sequence's length; the prompts are right-padded in
    `input_ids` and each sequence decodes at its own positions (its cache slots, rotary
    positions and index length), so a short prompt is never padded at the front. Its dense
    attention then reads a [B, 1, 1, S] mask of the slots each sequence has filled.

    Args:
        model: a transformers causal LM whose forward takes `position_ids` (Llama, Mistral, Qwen).
        input_ids: [B, P] int64 prompts (right-padded past `prompt_lengths`).
        max_new_tokens: tokens to generate per sequence (>= 1); the cache holds P + max_new_tokens.
        prompt_lengths: [B] lengths in [1, P] (a list or a tensor, read once), default all P.
        eos_token_id: a sequence that emits it emits it again at every later step (as transformers
            pads a finished sequence with it); the batch's graph keeps its shape and runs on.
        capture: replay a CUDA graph of the decode step (default: on a CUDA device).
        prefill_tokens: the most tokens (batch x chunk length) one prefill forward takes.
        compile: compile the decode step's forward with `torch.compile` (the first step compiles;
            the prefill stays eager). Dynamo keeps an entry per layer, and its recompile limit is
            raised to hold them; decoders of other models, attention implementations or batch
            shapes in the same process add as many: call `torch._dynamo.reset()` between them.
        fuse_projections: fuse the model's q/k/v and gate/up projections until `close()`.

    Example:
        >>> import transformers
        >>> cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=32,
        ...                                num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2)
        >>> model = transformers.LlamaForCausalLM(cfg).eval()
        >>> decoder = StaticDecoder(model, torch.randint(0, 64, (2, 8)), 4)
        >>> decoder.step()
        >>> decoder.steps_left, decoder.tokens.shape
        (2, torch.Size([2, 4]))
    """

    def __init__(
        self,
        model: torch.nn.Module,
        input_ids: torch.Tensor,
        max_new_tokens: int,
        *,
        prompt_lengths: Sequence[int] | torch.Tensor | None = None,
        eos_token_id: int | None = None,
        capture: bool | None = None,
        prefill_tokens: int = 131072,
        compile: bool = False,
        fuse_projections: bool = True,
    ) -> None:
        check.tensor("input_ids", input_ids, shape=(None, None), dims="[B, P]", dtypes=(torch.int64,))
        check.positive_int("max_new_tokens", max_new_tokens)
        check.positive_int("prefill_tokens", prefill_tokens)
        B, P = input_ids.shape
        if B == 0 or P == 0:
            raise ValueError(
                f"input_ids: expected at least one prompt of at least one token, got shape [{B}, {P}]"
            )
        vocab = getattr(model.config, "vocab_size", None)
        if vocab is not None:  # an id past the embedding would fault on the device (one sync, here)
            low, high = (int(x) for x in torch.aminmax(input_ids))
            if low < 0 or high >= vocab:
                raise ValueError(
                    f"input_ids: expected token ids in [0, vocab_size={vocab}), got ids from {low} to {high}"
                )
        dev = input_ids.device
        lengths = _prompt_lengths(prompt_lengths, B, P)
        ragged = min(lengths) < P
        self.capture = dev.type == "cuda" if capture is None else capture
        if self.capture and dev.type != "cuda":
            raise ValueError(f"capture: CUDA graphs need a CUDA device, got input_ids on {dev}")
        self.model, self.input_ids, self.max_new_tokens = model, input_ids, max_new_tokens
        self._forward = _compiled_forward(model) if compile else model
        self.position = torch.tensor(lengths, dtype=torch.int64, device=dev)[:, None]  # [B, 1]
        self.cache = StaticCache(config=model.config, max_cache_len=P + max_new_tokens)
        by_layer = {
            m.layer_idx: m._pqattn_state for m in model.modules() if getattr(m, "_pqattn_state", None)
        }
        if any(s.config.kv_placement == "host" for s in by_layer.values()):
            _host_tier_layers(model, self.cache, by_layer, B, P + max_new_tokens)
        elif ragged:
            _write_at_rows(self.cache, self.position)
        self._kw = cache_kwargs(model, self.cache) | {"use_cache": True}
        self.mask = None  # [B, 1, 1, S] the filled slots, for a ragged batch's dense attention
        if ragged:
            slots = torch.arange(P + max_new_tokens, device=dev)
            self.mask = (slots < self.position)[:, None, None, :]
            self._kw["attention_mask"] = self.mask
        self._states = [
            m._pqattn_state for m in model.modules() if getattr(m, "_pqattn_state", None) is not None
        ]
        self._fused, self._closed = fuse_projections, False
        if fuse_projections:
            projections.fuse(model)
        try:
            with torch.no_grad():
                first = self._prefill(input_ids, lengths, prefill_tokens)
        except BaseException:
            self.close()
            raise
        self.ids = first[:, None]  # [B, 1]: the token each decode step reads and overwrites
        self.eos = None if eos_token_id is None else torch.full_like(self.ids, eos_token_id)
        self.done = None if self.eos is None else self.ids == self.eos  # [B, 1] sequences that emitted eos
        self.tokens = torch.empty(B, max_new_tokens, dtype=torch.int64, device=dev)  # the new tokens
        self.tokens[:, :1] = self.ids
        self._column = torch.ones(1, dtype=torch.int64, device=dev)  # where the step writes in tokens
        self._made = 1
        self._graph: torch.cuda.CUDAGraph | None = None

    @property
    def steps_left(self) -> int:
        return self.max_new_tokens - self._made

    def _prefill(self, input_ids: torch.Tensor, lengths: list[int], prefill_tokens: int) -> torch.Tensor:
        """Prefill [B, P] in chunks of the sequence; returns [B] each prompt's next token."""
        B, P = input_ids.shape
        chunk = max(1, prefill_tokens // B)
        first = torch.empty(B, dtype=torch.int64, device=input_ids.device)
        kw = {k: v for k, v in self._kw.items() if k != "attention_mask"}  # right padding: causal only
        for state in self._states:
            state.prompt_lengths = lengths
        try:
            for start in range(0, P, chunk):
                end = min(P, start + chunk)
                rows = [b for b in range(B) if start <= lengths[b] - 1 < end]
                keep = sorted({lengths[b] - 1 - start for b in rows}) or [end - start - 1]
                positions = torch.arange(start, end, device=input_ids.device).expand(B, end - start)
                logits = self.model(
                    input_ids=input_ids[:, start:end],
                    position_ids=positions,
                    logits_to_keep=torch.tensor(keep, device=input_ids.device),
                    **kw,
                ).logits
                if rows:
                    at = torch.tensor(
                        [[b, keep.index(lengths[b] - 1 - start)] for b in rows], device=first.device
                    )
                    first[at[:, 0]] = logits[at[:, 0], at[:, 1]].argmax(-1)
        finally:
            for state in self._states:
                state.prompt_lengths = None
        return first

    @torch.no_grad()
    def _step(self) -> None:
        if self.mask is not None:
            self.mask.scatter_(3, self.position.view(-1, 1, 1, 1), True)
        out = self._forward(input_ids=self.ids, position_ids=self.position, **self._kw).logits
        self.ids.copy_(out[:, -1:].argmax(-1))
        if self.eos is not None:
            self.ids.copy_(torch.where(self.done, self.eos, self.ids))
            self.done.logical_or_(self.ids == self.eos)
        self.tokens.index_copy_(1, self._column, self.ids)
        self.position.add_(1)
        self._column.add_(1)

    def step(self) -> None:
        """One decode step of the batch (asynchronous once the graph is captured)."""
        if self._closed:
            raise ValueError("step: the decoder is closed")
        if self.steps_left <= 0:
            raise ValueError(f"step: all max_new_tokens={self.max_new_tokens} tokens are generated")
        if not self.capture or self._made == 1:
            self._step()
        else:
            if self._graph is None:
                self._graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(self._graph):
                    self._step()
            self._graph.replay()
            if self._made % PQIndex.REINDEX_AFTER == 0:  # replays advance the device lengths only
                self.sync_lengths()
        self._made += 1

    def sync_lengths(self) -> None:
        """Refresh the indexes' host length counters after graph replays (one sync each)."""
        for state in self._states:
            if state.index is not None and self._graph is not None:
                state.index.sync_lengths()

    def run(self) -> torch.Tensor:
        """Steps until max_new_tokens; returns [B, P + max_new_tokens] int64, the prompts then each
        sequence's continuation (for a ragged batch, from column P on)."""
        while self.steps_left > 0:
            self.step()
        self.sync_lengths()
        return torch.cat([self.input_ids, self.tokens], dim=1)

    def close(self) -> None:
        """Drop the captured graph and unfuse the model's projections (fuse_projections); the
        decoder takes no more steps. The tokens made so far stay in `tokens`."""
        if self._closed:
            return
        self._closed = True
        self._graph = None
        if self._fused:
            projections.unfuse(self.model)


def _compiled_forward(model: torch.nn.Module):
    """The model's forward through torch.compile, with room for every layer in dynamo's cache.

    Dynamo specialises the attention forward on the module's `layer_idx` (the cache update indexes
    a layer by it), so it keeps one compiled entry per layer; past `recompile_limit` entries (8 by
    default) the remaining layers would run eagerly. Another compiled decoder in the same process
    (another model, attention implementation or batch shape) adds as many entries again:
    `torch._dynamo.reset()` between them keeps each one compiled whole.
    """
    compiled = torch.compile(model, dynamic=False)
    limit = max(torch._dynamo.config.recompile_limit, 2 * model.config.num_hidden_layers)

    def forward(**kwargs):
        with torch._dynamo.config.patch(recompile_limit=limit):
            return compiled(**kwargs)

    return forward


def _prompt_lengths(prompt_lengths: Sequence[int] | torch.Tensor | None, B: int, P: int) -> list[int]:
    if prompt_lengths is None:
        return [P] * B
    got = torch.as_tensor(prompt_lengths).tolist()
    if not isinstance(got, list) or len(got) != B or not all(isinstance(n, int) and 1 <= n <= P for n in got):
        raise ValueError(f"prompt_lengths: expected {B} integers in [1, P={P}], got {got}")
    return got


def _write_at_rows(cache, position: torch.Tensor) -> None:
    """Make each layer of a StaticCache write a one-token update at each row's slot `position`
    [B, 1] (device) instead of one slot shared by the batch."""
    if any(type(layer) is not StaticLayer for layer in cache.layers):
        kinds = sorted({type(layer).__name__ for layer in cache.layers})
        raise ValueError(f"prompt_lengths: ragged batches need full-attention cache layers, got {kinds}")
    cache.layers = [_RowSlotLayer(layer.max_cache_len, position) for layer in cache.layers]


class _RowSlotLayer(StaticLayer):
    """A StaticCache layer whose one-token updates go to each row's own slot: `slots` [B, 1]
    int64 on the device, advanced by the decode loop (a scatter: capturable). Longer updates (the
    prefill) fill slots from 0 for every row, as StaticLayer does."""

    def __init__(self, max_cache_len: int, slots: torch.Tensor) -> None:
        super().__init__(max_cache_len)
        self.slots = slots

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized or key_states.shape[-2] != 1:
            return super().update(key_states, value_states, *args, **kwargs)
        self.cumulative_length.add_(1)
        at = self.slots.view(-1, 1, 1, 1)
        self.keys.scatter_(2, at.expand(key_states.shape), key_states)
        self.values.scatter_(2, at.expand(value_states.shape), value_states)
        return self.keys, self.values


class _HostLayer(StaticLayer):
    """A StaticCache layer whose keys and values live in host memory (kv_placement="host"): a
    prefill chunk is stored into the layer's host rows [B, Hkv, max_cache_len, 2, D] as it comes
    and returned with the earlier chunks brought back from them (one layer's prompt on the GPU at a
    time); a decode step's update returns the new token alone (its layer's HostCache stores it)."""

    def __init__(self, max_cache_len: int, state: _LayerState) -> None:
        super().__init__(max_cache_len)
        self.state = state
        self.filled = 0  # prompt tokens stored
        self.rows: torch.Tensor | None = None
        state.host_layer = self

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device = key_states.device
        self.batch_size, self.num_heads, _, self.k_head_dim = key_states.shape
        self.v_head_dim = value_states.shape[-1]
        if self.v_head_dim != self.k_head_dim:
            raise ValueError(
                f"kv_placement: 'host' keeps keys and values of one head dim, got {self.k_head_dim} "
                f"and {self.v_head_dim}"
            )
        int8 = self.state.config.host_int8
        shape = host_tier.host_rows_shape(
            self.batch_size, self.num_heads, self.max_cache_len, self.k_head_dim, int8
        )
        self.rows = host_tier.mapped_host_empty(shape, torch.uint8 if int8 else key_states.dtype, self.device)
        self.keys = self.values = None
        self.cumulative_length = self.cumulative_length.to(self.device)
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        T = key_states.shape[-2]
        self.cumulative_length.add_(T)
        if self.state.prompt_lengths is None:  # a decode step
            return key_states, value_states
        start = self.filled
        if start + T > self.max_cache_len:
            raise ValueError(
                f"input_ids: expected at most {self.max_cache_len} prompt tokens, got {start + T}"
            )
        for b in range(self.batch_size):
            for h in range(self.num_heads):
                encoded = ref.encode_rows(key_states[b, h], value_states[b, h], self.rows.dtype)
                self.rows[b, h, start : start + T].copy_(encoded)
        self.filled += T
        if start == 0:
            return key_states, value_states
        past = ref.decode_rows(self.rows[:, :, :start].to(self.device), self.k_head_dim)
        k, v = (x.to(key_states.dtype) for x in past)
        return torch.cat((k, key_states), 2), torch.cat((v, value_states), 2)


def _host_tier_layers(
    model: torch.nn.Module, cache: StaticCache, states: dict[int, _LayerState], batch: int, max_len: int
) -> None:
    """Give each layer of `cache` a host tier (kv_placement="host"), after checking that the whole
    model's host and GPU footprint fits the machine (before anything is allocated). Row caches of
    the default size shrink, a list width at a time and with a warning, to what the GPU holds."""
    cfg = model.config
    H, Hkv = cfg.num_attention_heads, cfg.num_key_value_heads
    D = getattr(cfg, "head_dim", None) or cfg.hidden_size // H
    dtype = next(model.parameters()).dtype
    device = next(model.parameters()).device

    def slots(s: _LayerState, widths: int | None) -> int | None:
        if widths is None:
            return s.config.host_slots
        width = host_tier.list_width(s.config.index_config(max_len), H, Hkv, max_len)
        return host_tier.row_cache_slots(width, max_len, widths)

    def need(widths: int | None) -> host_tier.Footprint:
        """The model's footprint with `widths` list widths of slots (None: each layer's host_slots)."""
        one = [
            host_tier.footprint(
                s.config.index_config(max_len), batch=batch, query_heads=H, kv_heads=Hkv, head_dim=D,
                capacity=max_len, dtype=dtype, slots=slots(s, widths), int8=s.config.host_int8,
            )
            for s in states.values()
        ]  # fmt: skip
        return host_tier.Footprint(sum(f.host for f in one), sum(f.gpu for f in one))

    widths = host_tier.ROW_CACHE_LISTS if all(s.config.host_slots is None for s in states.values()) else None
    free = host_tier.free_gpu_bytes(device)
    footprint = need(widths)
    if widths is not None and free is not None and footprint.gpu > free:
        while widths > 1 and footprint.gpu > free:
            widths -= 1
            footprint = need(widths)
        warnings.warn(
            f"pqattn: the host tier's row caches shrink from the default {host_tier.ROW_CACHE_LISTS} "
            f"list widths of slots to {widths}: what {free / 1e9:.2f} GB of free GPU memory holds "
            "(fewer slots, a lower hit rate; HFConfig.host_slots sets them)",
            stacklevel=_caller_level(),
        )
    for s in states.values():
        s.host_slots = slots(s, widths)
    host_tier.check_fits(footprint, device, "input_ids / max_new_tokens")
    if sorted(states) != list(range(len(cache.layers))):
        raise ValueError(
            f"kv_placement: 'host' needs every one of the cache's {len(cache.layers)} layers enabled, "
            f"got layers {sorted(states)}"
        )
    cache.layers = [_HostLayer(layer.max_cache_len, states[i]) for i, layer in enumerate(cache.layers)]


def generate(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    max_new_tokens: int,
    *,
    prompt_lengths: Sequence[int] | torch.Tensor | None = None,
    eos_token_id: int | None = None,
    capture: bool | None = None,
    compile: bool = False,
    fuse_projections: bool = True,
) -> torch.Tensor:
    """Greedy decoding through a StaticCache, the decode step captured as one CUDA graph and
    replayed: `StaticDecoder(...).run()`, whose arguments these are.

    Returns:
        [B, P + max_new_tokens] int64: the prompts and their greedy continuations (for a ragged
        batch, each continuation from column P on).

    Example:
        >>> import transformers
        >>> cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=32,
        ...                                num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2)
        >>> model = transformers.LlamaForCausalLM(cfg).eval()
        >>> generate(model, torch.randint(0, 64, (2, 8)), 4).shape
        torch.Size([2, 12])
    """
    decoder = StaticDecoder(
        model,
        input_ids,
        max_new_tokens,
        prompt_lengths=prompt_lengths,
        eos_token_id=eos_token_id,
        capture=capture,
        compile=compile,
        fuse_projections=fuse_projections,
    )
    try:
        return decoder.run()
    finally:
        decoder.close()


def disable(model: torch.nn.Module, implementation: str = "sdpa") -> None:
    """Drop the indexes and go back to `implementation`."""
    for module in model.modules():
        if hasattr(module, "_pqattn_state"):
            del module._pqattn_state
    model.set_attn_implementation(implementation)


def _kv_head_share(module, key: torch.Tensor) -> dict:
    """The rank's share of the KV heads under tensor parallelism (tp_plan="auto" splits them in
    rank order): the index build then draws the one-process build's init for those heads."""
    total = getattr(getattr(module, "config", None), "num_key_value_heads", None)
    local = key.shape[1]
    if total is None or local >= total or not torch.distributed.is_initialized():
        return {}
    return {"head_offset": torch.distributed.get_rank() * local, "total_heads": total}
