"""A tensor-parallel rank's weight products in a decode step, unfused against fused (a kernel
figure, not the user's path: `bench/tp_generate.py` times that on a multi-GPU host).

For a Llama-3-8B layer (hidden 4096, 32 heads, 8 KV heads of 128, MLP 14336) split over `tp`
ranks as transformers' tp_plan splits it, the rank's local products of B tokens: q, k, v, gate and
up (colwise: their output rows / tp) and o, down (rowwise: their input columns / tp), each its
own GEMM ("unfused"), or q/k/v and gate/up as one GEMM each ("fused", what
`pqattn.integrations.projections` runs on each rank). One CUDA graph holds the step's products
over `layers` layers of distinct weights (more than twice the L2); GPU time per step by graph
replay, beside the weights' bytes at the measured copy rate; then each of the fused step's
products alone over the layers.

Usage: PYTHONPATH=src python3 bench/tp_rank_gemms.py [--tp 1,2,4] [--batch 8] [--layers 8] [--json PATH]
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F

from pqattn.lab.env import environment
from pqattn.lab.roofline import measure_ceilings
from pqattn.lab.timing import capture, time_graph

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, MLP = 4096, 32, 8, 128, 14336


def rank_weights(tp: int, device: torch.device, g: torch.Generator) -> dict[str, torch.Tensor]:
    """One layer's local weights on a rank of `tp` (bfloat16, [outputs, inputs])."""
    shapes = {
        "q": (HEADS * HEAD_DIM // tp, HIDDEN),
        "k": (KV_HEADS * HEAD_DIM // tp, HIDDEN),
        "v": (KV_HEADS * HEAD_DIM // tp, HIDDEN),
        "o": (HIDDEN, HEADS * HEAD_DIM // tp),
        "gate": (MLP // tp, HIDDEN),
        "up": (MLP // tp, HIDDEN),
        "down": (HIDDEN, MLP // tp),
    }
    w = {k: torch.randn(s, device=device, generator=g).bfloat16() for k, s in shapes.items()}
    w["qkv"] = torch.cat([w["q"], w["k"], w["v"]])
    w["gate_up"] = torch.cat([w["gate"], w["up"]])
    return w


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--tp", default="1,2,4")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--json")
    a = p.parse_args()
    dev = torch.device("cuda")
    ceilings = measure_ceilings(dev)
    g = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    for tp in (int(t) for t in a.tp.split(",")):
        layers = [rank_weights(tp, dev, g) for _ in range(a.layers)]
        x = torch.randn(a.batch, HIDDEN, device=dev, generator=g).bfloat16()
        xo = torch.randn(a.batch, HEADS * HEAD_DIM // tp, device=dev, generator=g).bfloat16()
        xd = torch.randn(a.batch, MLP // tp, device=dev, generator=g).bfloat16()
        steps = {
            "unfused": [("q", x), ("k", x), ("v", x), ("o", xo), ("gate", x), ("up", x), ("down", xd)],
            "fused": [("qkv", x), ("o", xo), ("gate_up", x), ("down", xd)],
        }
        names = ("q", "k", "v", "o", "gate", "up", "down")
        weight_bytes = sum(w[k].numel() * w[k].element_size() for w in layers for k in names)
        row = {"tp": tp, "batch": a.batch, "layers": a.layers, "weight_bytes": weight_bytes}
        row["floor_us"] = weight_bytes / (ceilings["copy_gbps"] * 1e3)
        for name, ops in steps.items():

            def step(ops=ops, layers=layers) -> None:
                for w in layers:
                    for k, inp in ops:
                        F.linear(inp, w[k])

            graph = capture([step], dev, calls=1)
            row[name + "_us"] = time_graph(graph, dev, repeats=30, calls=1)["median_us"]
            row[name + "_launches"] = len(ops) * a.layers
            del graph
        row["saved_us"] = row["unfused_us"] - row["fused_us"]
        for name in steps:
            row[name + "_x"] = row[name + "_us"] / row["floor_us"]
        row["ops"] = {}  # the fused step's products one at a time: us over the layers, and floor
        for k, inp in steps["fused"]:

            def op(k=k, inp=inp, layers=layers) -> None:
                for w in layers:
                    F.linear(inp, w[k])

            graph = capture([op], dev, calls=1)
            nbytes = sum(w[k].numel() * w[k].element_size() for w in layers)
            us = time_graph(graph, dev, repeats=30, calls=1)["median_us"]
            row["ops"][k] = {"us": us, "floor_us": nbytes / (ceilings["copy_gbps"] * 1e3)}
            del graph
        rows.append(row)
        print(
            f"tp {tp}: unfused {row['unfused_us']:.1f} us, fused {row['fused_us']:.1f} us "
            f"(saves {row['saved_us']:.1f}), floor {row['floor_us']:.1f} us for {a.layers} layers | "
            + ", ".join(f"{k} {v['us']:.1f} ({v['floor_us']:.1f})" for k, v in row["ops"].items()),
            flush=True,
        )
        del layers
        torch.cuda.empty_cache()
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"env": environment(dev), "ceilings": ceilings, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
