"""What the tensor-parallel test workers share (imported from their own folder under torchrun)."""

from __future__ import annotations

import json
import os

import torch
import transformers

from pqattn.integrations import tensor_parallel


def load(path: str, plan: dict[str, str] | None = None) -> tuple[transformers.PreTrainedModel, torch.Tensor]:
    """(the model at `path` loaded with tp_plan="auto" in float32 on this rank's device, its plan's
    entries replaced by `plan`; a fixed prompt [2, 16] of its vocabulary)."""
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    kwargs = tensor_parallel.from_pretrained_kwargs()
    config = transformers.AutoConfig.from_pretrained(path)
    config.base_model_tp_plan = {**config.base_model_tp_plan, **(plan or {})}
    model = transformers.AutoModelForCausalLM.from_pretrained(
        path, config=config, dtype=torch.float32, **kwargs
    ).eval()
    ids = torch.randint(0, model.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    return model, ids.to(model.device)


def finish(doc: dict, out: str) -> None:
    """Rank 0 writes `doc` to `out`; every rank leaves the process group."""
    if torch.distributed.get_rank() == 0:
        with open(out, "w") as f:
            json.dump(doc, f)
    torch.distributed.destroy_process_group()
