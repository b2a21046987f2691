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
layers), on a real device, of one dtype, device and input width, all with or all without a bias,
each weight used by that linear only, and either with plain tensors and no hooks, or (tensor
parallelism, transformers' `tp_plan`) with DTensor weights sharded along the outputs on one
one-dimensional mesh ("colwise"). A rank's sharded group fuses its local shards: each linear
keeps its DTensor parameters (views of the rank's fused buffer) and transformers' own forward,
and is called through a forward that takes the slice of the group's local product, which is what
a colwise linear returns on a replicated input (there is no communication to skip). A DTensor
input, extra arguments or gradients take transformers' forward. A sharded group is fused only if
each linear's own call returns its local product (probed once, at `fuse`): not for a forward hook,
nor for styles that gather the output ("colwise_rep").
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

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

    def slice(self, x: torch.Tensor, start: int, stop: int) -> torch.Tensor:
        """Outputs [start, stop) of the group's product with x (computed once per input)."""
        if self.x is not x:
            self.x, self.out = x, F.linear(x, self.weight, self.bias)
        return self.out[..., start:stop]


class FusedLinear(torch.nn.Linear):
    """An `nn.Linear` of a fused group: outputs [start, stop) of the group's product."""

    _pqattn_group: _Group
    _pqattn_span: tuple[int, int]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.weight.requires_grad and torch.is_grad_enabled():
            return F.linear(x, self.weight, self.bias)  # the group's product carries no gradient
        return self._pqattn_group.slice(x, *self._pqattn_span)


def _sharded_forward(module: torch.nn.Linear, original):
    """A colwise-sharded linear's forward while its group is fused: the slice of the group's local
    product; transformers' forward (`original`) for a DTensor input, extra arguments or gradients."""

    def forward(x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        grads = module.weight.requires_grad and torch.is_grad_enabled()
        if args or kwargs or isinstance(x, DTensor) or grads:
            return original(x, *args, **kwargs)
        return module._pqattn_group.slice(x, *module._pqattn_span)

    return forward


def _fusion(parts: list[torch.nn.Module], uses: dict[int, int]) -> str | None:
    """How a group's linears fuse (the module docstring): "plain", "sharded" or None (not at all);
    uses: how many times each parameter (by id) appears in the model."""
    first = parts[0]
    if not all(type(p) is torch.nn.Linear for p in parts):
        return None
    params = [p.weight for p in parts] + [p.bias for p in parts if p.bias is not None]
    alike = (
        all(not t.is_meta and uses.get(id(t)) == 1 for t in params)
        and all(
            p.weight.dtype == first.weight.dtype
            and p.weight.device == first.weight.device
            and p.in_features == first.in_features
            and (p.bias is None) == (first.bias is None)
            and not hasattr(p, "_hf_hook")
            for p in parts
        )
        and (first.bias is None or all(p.bias.dtype == first.bias.dtype for p in parts))
    )
    if not alike:
        return None
    if all(type(t.data) is torch.Tensor for t in params):
        plain = not any(p._forward_hooks or p._forward_pre_hooks for p in parts)
        return "plain" if plain else None
    mesh = first.weight.device_mesh if isinstance(first.weight, DTensor) else None
    # (a forward hook would post-process the slice as transformers' output; pre-hooks are served:
    # a DTensor input takes transformers' forward)
    colwise = not any(p._forward_hooks for p in parts) and all(
        isinstance(t, DTensor)
        and t.device_mesh is mesh
        and mesh.ndim == 1
        and len(t.placements) == 1
        and t.placements[0].is_shard()
        and t.placements[0].dim % t.ndim == 0  # along the outputs (a bias's Shard(-1) too)
        for t in params
    )
    return "sharded" if colwise and all(_gives_local_product(p) for p in parts) else None


def _gives_local_product(linear: torch.nn.Linear) -> bool:
    """Whether a sharded linear's own call (transformers' forward and hooks) returns its local
    product on a replicated input: a plain tensor equal to F.linear with its local shards. Not so
    for the styles that gather the output ("colwise_rep") or keep it a DTensor. Every rank probes
    its linears in the same order (a gathering style's call is a collective)."""
    weight = linear.weight.to_local()
    x = torch.ones(1, linear.in_features, dtype=weight.dtype, device=weight.device)
    got = linear(x)
    want = F.linear(x, weight, None if linear.bias is None else _local(linear.bias))
    if type(got) is not torch.Tensor or got.shape != want.shape:
        return False
    tol = max(4 * torch.finfo(weight.dtype).eps, 1e-5)  # another GEMM's rounding passes, another slice not
    return torch.allclose(got.float(), want.float(), rtol=tol, atol=tol * float(want.abs().max()))


def _view(parameter: torch.nn.Parameter, data: torch.Tensor) -> torch.nn.Parameter:
    """A parameter like `parameter` over `data`: a DTensor parameter keeps its mesh, placements
    and global shape with `data` as its local shard."""
    if isinstance(parameter.data, DTensor):
        p = parameter.data
        data = DTensor.from_local(
            data, p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride()
        )
    return torch.nn.Parameter(data, requires_grad=parameter.requires_grad)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


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
            kind = None if any(p is None for p in parts) else _fusion(parts, uses)
            if kind is None:
                continue
            weight = torch.cat([_local(p.weight) for p in parts])
            bias = None if parts[0].bias is None else torch.cat([_local(p.bias) for p in parts])
            group = _Group(weight, bias)
            start = 0
            for p in parts:
                stop = start + _local(p.weight).shape[0]
                p.weight = _view(p.weight, weight[start:stop])
                if bias is not None:
                    p.bias = _view(p.bias, bias[start:stop])
                p._pqattn_group, p._pqattn_span = group, (start, stop)
                if kind == "plain":
                    p.__class__ = FusedLinear
                else:  # transformers' forward (an instance attribute, or the class's) kept aside
                    p._pqattn_forward = p.__dict__.get("forward")
                    p.forward = _sharded_forward(p, p.forward)
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
    groups: dict[int, tuple[_Group, list[torch.nn.Linear]]] = {}
    for module in model.modules():
        group = getattr(module, "_pqattn_group", None)
        if group is not None:
            groups.setdefault(id(group), (group, []))[1].append(module)
    for group, parts in groups.values():  # a group's buffer is freed before the next is copied
        for module in parts:
            module.weight = _view(module.weight, _local(module.weight).clone())
            if module.bias is not None:
                module.bias = _view(module.bias, _local(module.bias).clone())
            if type(module) is FusedLinear:
                module.__class__ = torch.nn.Linear
            else:
                original = module.__dict__.pop("_pqattn_forward")
                if original is None:
                    del module.forward
                else:
                    module.forward = original
            del module._pqattn_group, module._pqattn_span
        group.hook.remove()
        group.drop()
        group.weight = group.bias = None
    if count:
        del model._pqattn_fused
    return 0


def _fused_groups(model: torch.nn.Module) -> int:
    return len({id(m._pqattn_group) for m in model.modules() if hasattr(m, "_pqattn_group")})
