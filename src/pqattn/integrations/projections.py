"""Linears that read one input, run as one GEMM: an attention's q/k/v projections and a gated
MLP's gate/up projections (a transformers model's `q_proj`, `k_proj`, `v_proj` and `gate_proj`,
`up_proj`). A decode step then reads those weights in two launches a layer instead of five, with
no split-K reduce of the small k/v products.

`fuse(model)` concatenates each group's weights (and biases) along the outputs into one buffer
and makes every linear's parameters views of it: the model keeps its parameters' names, shapes
and values, and its memory does not grow. The first linear of a group called on an input computes the group's
product and keeps it; the group's others take their slices of it when called on the same input
(a linear called on another input computes the group's product for it); the parent module's
forward drops it on return (with gradients enabled for the parameters, each linear computes its
own product, as before). `unfuse(model)` gives every parameter its own storage back (while
fused, safetensors refuses to save parameters that share storage, and the parameters must not be
moved or converted: the product reads the fused buffer). Calls nest: a model fused twice is
restored by its second `unfuse`.

Groups are fused only where every linear is a plain `nn.Linear` (not a subclass: quantized
layers), with plain tensors (not DTensor shards), on a real device, of one dtype, device and
input width, all with or all without a bias, without hooks, each weight used by that linear only.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


class _Group:
    """The fused weight [sum of outputs, inputs] and bias of a group, and its last product."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        self.weight, self.bias = weight, bias
        self.x: torch.Tensor | None = None
        self.out: torch.Tensor | None = None
        self.hook: torch.utils.hooks.RemovableHandle | None = None

    def drop(self, *_) -> None:
        self.x = self.out = None


class FusedLinear(torch.nn.Linear):
    """An `nn.Linear` of a fused group: outputs [start, stop) of the group's product."""

    _pqattn_group: _Group
    _pqattn_span: tuple[int, int]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.weight.requires_grad and torch.is_grad_enabled():
            return F.linear(x, self.weight, self.bias)  # the group's product carries no gradient
        group = self._pqattn_group
        if group.x is not x:
            group.x, group.out = x, F.linear(x, group.weight, group.bias)
        start, stop = self._pqattn_span
        return group.out[..., start:stop]


def _fusable(parts: list[torch.nn.Module], uses: dict[int, int]) -> bool:
    """Whether a group's linears fuse (the module docstring); uses: how many times each
    parameter (by id) appears in the model."""
    first = parts[0]
    if not all(type(p) is torch.nn.Linear for p in parts):
        return False
    params = [p.weight for p in parts] + [p.bias for p in parts if p.bias is not None]
    return (
        all(type(t.data) is torch.Tensor and not t.is_meta and uses.get(id(t)) == 1 for t in params)
        and all(
            p.weight.dtype == first.weight.dtype
            and p.weight.device == first.weight.device
            and p.in_features == first.in_features
            and (p.bias is None) == (first.bias is None)
            and not (p._forward_hooks or p._forward_pre_hooks or hasattr(p, "_hf_hook"))
            for p in parts
        )
        and (first.bias is None or all(p.bias.dtype == first.bias.dtype for p in parts))
    )


def _view(parameter: torch.nn.Parameter, data: torch.Tensor) -> torch.nn.Parameter:
    return torch.nn.Parameter(data, requires_grad=parameter.requires_grad)


@torch.no_grad()
def fuse(model: torch.nn.Module) -> int:
    """Fuse the model's q/k/v and gate/up groups (see the module docstring); returns how many
    groups are fused after the call (a model already fused counts one more fusion to undo)."""
    count = getattr(model, "_pqattn_fused", 0)
    if count:
        model._pqattn_fused = count + 1
        return _fused_groups(model)
    uses: dict[int, int] = {}
    for _, p in model.named_parameters(remove_duplicate=False):
        uses[id(p)] = uses.get(id(p), 0) + 1
    for parent in list(model.modules()):
        for names in GROUPS:
            parts = [getattr(parent, n, None) for n in names]
            if any(p is None for p in parts) or not _fusable(parts, uses):
                continue
            weight = torch.cat([p.weight for p in parts])
            bias = None if parts[0].bias is None else torch.cat([p.bias for p in parts])
            group = _Group(weight, bias)
            start = 0
            for p in parts:
                stop = start + p.out_features
                p.weight = _view(p.weight, weight[start:stop])
                if bias is not None:
                    p.bias = _view(p.bias, bias[start:stop])
                p.__class__ = FusedLinear
                p._pqattn_group, p._pqattn_span = group, (start, stop)
                start = stop
            group.hook = parent.register_forward_hook(group.drop)
    model._pqattn_fused = 1
    return _fused_groups(model)


@torch.no_grad()
def unfuse(model: torch.nn.Module) -> int:
    """Undo one `fuse`: the last one gives each fused linear its own weight and bias again (and
    its class, nn.Linear). Returns the groups still fused."""
    count = getattr(model, "_pqattn_fused", 0)
    if count > 1:
        model._pqattn_fused = count - 1
        return _fused_groups(model)
    groups: dict[int, tuple[_Group, list[FusedLinear]]] = {}
    for module in model.modules():
        if type(module) is FusedLinear:
            group = module._pqattn_group
            groups.setdefault(id(group), (group, []))[1].append(module)
    for group, parts in groups.values():  # a group's buffer is freed before the next is copied
        for module in parts:
            module.weight = _view(module.weight, module.weight.clone())
            if module.bias is not None:
                module.bias = _view(module.bias, module.bias.clone())
            module.__class__ = torch.nn.Linear
            del module._pqattn_group, module._pqattn_span
        group.hook.remove()
        group.drop()
        group.weight = group.bias = None
    if count:
        del model._pqattn_fused
    return 0


def _fused_groups(model: torch.nn.Module) -> int:
    return len({id(m._pqattn_group) for m in model.modules() if type(m) is FusedLinear})
