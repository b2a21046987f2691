"""One rank of `test_tensor_parallel.py`'s fused-projections test (run under torchrun): a tiny
model loaded with tp_plan="auto", its logits with transformers' colwise q/k/v and gate/up linears,
then with each rank's local shards fused (`projections.fuse`), then unfused. Rank 0 writes the
JSON at argv[2].

Usage: torchrun --nproc-per-node N tests/integrations/tp_projections_worker.py MODEL_DIR OUT.json PLAN
(PLAN: auto, or gathered)
"""

from __future__ import annotations

import sys

import torch
from torch.distributed.tensor import DTensor
from tp_worker import finish, load

from pqattn.integrations import projections


def _storage(t: torch.Tensor) -> int:
    return t.to_local().untyped_storage().data_ptr()


# argv[3] "gathered": the MLP's gate/up outputs gathered ("colwise_rep"), its down projection
# splitting its replicated input: those groups must stay unfused
GATHERED = {
    "layers.*.mlp.gate_proj": "colwise_rep",
    "layers.*.mlp.up_proj": "colwise_rep",
    "layers.*.mlp.down_proj": "rowwise_split_input",
}


def main() -> None:
    path, out = sys.argv[1], sys.argv[2]
    model, ids = load(path, GATHERED if sys.argv[3] == "gathered" else None)
    attn = model.model.layers[0].self_attn
    forwards = {n: getattr(attn, n).__dict__.get("forward") for n in ("q_proj", "k_proj", "v_proj")}
    with torch.no_grad():
        want = model(ids, use_cache=False).logits
        fused = projections.fuse(model)
        group = (attn.q_proj, attn.k_proj, attn.v_proj)
        products = []  # whether each call took the group's product (kept until the parent returns)
        hook = attn.v_proj.register_forward_hook(lambda m, *_: products.append(m._pqattn_group.x is not None))
        doc = {
            "world_size": torch.distributed.get_world_size(),
            "fused": fused,
            "dtensors": all(isinstance(p.weight.data, DTensor) for p in group),
            "shared_storage": len({_storage(p.weight) for p in group}) == 1,
            "sharded_forward": all("forward" in p.__dict__ for p in group),
            "fused_max_diff": (model(ids, use_cache=False).logits - want).abs().max().item(),
            "group_products": products,
        }
        hook.remove()
        doc["with_bias"] = attn.q_proj.bias is not None
        if doc["with_bias"]:
            doc["bias_shared_storage"] = _storage(attn.q_proj.bias) == _storage(attn.v_proj.bias)
        doc["unfused"] = projections.unfuse(model)
        doc["own_storage"] = len({_storage(p.weight) for p in group}) == 3
        doc["forwards_restored"] = all(
            getattr(attn, n).__dict__.get("forward") is f for n, f in forwards.items()
        )
        doc["unfused_max_diff"] = (model(ids, use_cache=False).logits - want).abs().max().item()
    finish(doc, out)


if __name__ == "__main__":
    main()
