"""A one-shot all-reduce for transformers' tensor parallelism (`tp_plan="auto"`).

Each decode step of a tensor-parallel model sums every row-parallel linear's partial output over
the ranks (two a layer: the attention's output projection and the MLP's down projection). The
process group's all-reduce (NCCL's ring) takes several steps for such small messages (B x hidden
elements). Here each rank instead writes its partial into a buffer of torch symmetric memory and
one kernel reads every peer's copy over NVLink and sums them: one launch, no protocol rounds, and
capturable in a CUDA graph (the buffer is exchanged once, when it is installed).

Only NVLink peer reads: NVLink multicast (`multimem`) stays off.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

ONE_SHOT_MAX_BYTES = 1 << 20  # larger outputs (a prompt's) go to the process group's all-reduce


def from_pretrained_kwargs() -> dict:
    """`from_pretrained`'s tensor-parallel arguments for this transformers: a DistributedConfig
    where it takes one (passing `tp_plan` alone is deprecated there), else `tp_plan`."""
    import inspect

    try:
        from transformers.distributed import DistributedConfig
    except ImportError:
        return {"tp_plan": "auto"}
    if "tp_plan" not in inspect.signature(DistributedConfig).parameters:
        return {"tp_plan": "auto"}
    return {"distributed_config": DistributedConfig(tp_plan="auto")}


class OneShotAllReduce:
    """The sum over a process group's ranks, in place, of tensors of up to `max_numel` elements of
    `dtype` on `device`, by torch's one-shot all-reduce (`torch.ops.symm_mem`): the partial is
    copied into this rank's symmetric buffer, and each rank reads every peer's buffer. Larger
    tensors, or another dtype, take the group's all-reduce (`dist.all_reduce`).

    Collective: every rank constructs its instances in the same order (the buffer's rendezvous)."""

    def __init__(self, group: dist.ProcessGroup, *, device: torch.device, dtype: torch.dtype, max_numel: int):
        if device.type != "cuda":
            raise ValueError(
                f"device: the one-shot all-reduce reads peers' GPU memory; expected cuda, got {device}"
            )
        if dtype not in (torch.bfloat16, torch.float32):
            raise TypeError(f"dtype: expected torch.bfloat16 or torch.float32 (the kernel's), got {dtype}")
        if max_numel < 1:
            raise ValueError(f"max_numel: expected at least 1, got {max_numel}")
        # the copy into the buffer inside the kernel where this torch has it, else a copy first
        self.copy_in = hasattr(torch.ops.symm_mem, "one_shot_all_reduce_copy_out")
        if not self.copy_in and not hasattr(torch.ops.symm_mem, "one_shot_all_reduce_out"):
            raise RuntimeError(f"torch {torch.__version__} lacks symm_mem.one_shot_all_reduce_out")
        from torch.distributed import _symmetric_memory as symm_mem

        self.group = group
        self.group_name = group.group_name
        self.buffer = symm_mem.empty(max_numel, dtype=dtype, device=device)
        symm_mem.rendezvous(self.buffer, self.group_name)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x (any shape, contiguous) summed over the ranks, in place; returns x."""
        n = x.numel()
        if n > self.buffer.numel() or x.dtype != self.buffer.dtype or not x.is_contiguous():
            dist.all_reduce(x, group=self.group)
            return x
        flat, buffer = x.view(-1), self.buffer[:n]
        if self.copy_in:
            torch.ops.symm_mem.one_shot_all_reduce_copy_out(buffer, flat, "sum", self.group_name, flat)
        else:
            buffer.copy_(flat)
            torch.ops.symm_mem.one_shot_all_reduce_out(buffer, "sum", self.group_name, flat)
        return x


def row_parallel_linears(model: torch.nn.Module) -> list[tuple[str, torch.nn.Linear]]:
    """(name, module) of the model's row-parallel linears: `nn.Linear` whose weight is a DTensor
    sharded along its input dimension on a one-dimensional mesh (transformers' "rowwise")."""
    found = []
    for name, module in model.named_modules():
        weight = getattr(module, "weight", None)
        if not isinstance(module, torch.nn.Linear) or not isinstance(weight, DTensor):
            continue
        placements = weight.placements
        if weight.device_mesh.ndim == 1 and placements[0].is_shard() and placements[0].dim in (1, -1):
            found.append((name, module))
    return found


def use_one_shot_all_reduce(model: torch.nn.Module, *, max_bytes: int = ONE_SHOT_MAX_BYTES) -> int:
    """Make the model's row-parallel linears sum their outputs by `OneShotAllReduce` (outputs of
    at most `max_bytes`; larger ones, a prompt's, by the process group's all-reduce) and return how
    many were changed. Call it on every rank after loading the model with `tp_plan="auto"` and
    before capturing a CUDA graph of its forward (it exchanges one buffer per process group and
    dtype). `max_bytes=0` keeps every sum on the process group's all-reduce (a CPU/gloo run).

    Under autograd, or given a DTensor input, a linear runs transformers' own forward."""
    if max_bytes < 0:
        raise ValueError(f"max_bytes: expected >= 0, got {max_bytes}")
    linears = row_parallel_linears(model)
    if not linears:
        raise ValueError(
            "model: no row-parallel nn.Linear (a DTensor weight sharded along its input dimension); "
            'load it with tp_plan="auto" under torchrun'
        )
    reducers: dict[tuple[str, torch.dtype], OneShotAllReduce | None] = {}
    for _, module in linears:
        weight = module.weight
        group = weight.device_mesh.get_group()
        key = (group.group_name, weight.dtype)
        if key not in reducers:
            numel = max_bytes // weight.element_size()
            reducers[key] = (
                OneShotAllReduce(group, device=weight.device, dtype=weight.dtype, max_numel=numel)
                if numel
                else None
            )
        module.forward = _summed_forward(module, module.forward, group, reducers[key])
    return len(linears)


def _summed_forward(
    module: torch.nn.Linear, original, group: dist.ProcessGroup, reducer: OneShotAllReduce | None
):
    """The rank's partial product (its input's slice times its weight's columns) summed over the
    ranks by `reducer` (None: the group's all-reduce), then the replicated bias."""
    weight = module.weight.to_local()
    bias = module.bias.to_local() if isinstance(module.bias, DTensor) else module.bias

    def forward(x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        if args or kwargs or isinstance(x, DTensor) or torch.is_grad_enabled():
            return original(x, *args, **kwargs)
        y = F.linear(x, weight)
        if reducer is None:
            dist.all_reduce(y, group=group)
        else:
            reducer(y)
        return y if bias is None else y + bias

    return forward
