"""The group decode kernel's configs against list width: GPU time of every candidate config at
widths from 1K to 64K rows per KV head (B=1 and B=8, H=32, Hkv=8, D=128, bf16), beside the bytes
floor (the selected K and V rows and their positions at the measured copy bandwidth).

Positions are sorted random rows of a 256K-token cache (1 GiB of K and V), a fresh set per call
of the graph (16 sets), so the rows come from HBM, not L2.

Usage: PYTHONPATH=src python3 bench/group_decode_sweep.py [--json PATH] [--candidates]
  --candidates times CANDIDATES (a superset of GROUP_DECODE_CONFIGS) instead of the space in force.
"""

from __future__ import annotations

import argparse
import json

import torch
import triton

from pqattn.kernels import decode
from pqattn.lab.env import environment
from pqattn.lab.fidelity import copy_bandwidth
from pqattn.lab.timing import capture, time_graph

H, HKV, D, CACHE = 32, 8, 128, 262144
SETS, CALLS = 16, 16
WIDTHS = (1024, 2748, 4096, 10614, 16384, 42070, 65536)
CANDIDATES = [
    triton.Config({"BLOCK_L": bl, "BLOCK_N": bn}, num_warps=w, num_stages=s)
    for bl, bn, w, s in (
        (64, 32, 2, 1),
        (128, 32, 2, 1),
        (128, 64, 4, 1),
        (256, 32, 2, 1),
        (256, 64, 4, 1),
        (256, 64, 4, 2),
        (256, 128, 8, 1),
        (512, 64, 4, 1),
        (512, 128, 8, 1),
        (1024, 64, 4, 1),
        (1024, 128, 8, 1),
    )
]


def name(c: triton.Config) -> str:
    return f"{c.kwargs['BLOCK_L']}/{c.kwargs['BLOCK_N']}/w{c.num_warps}/s{c.num_stages}"


def time_width(x: dict, B: int, width: int, configs, gbps: float, g: torch.Generator) -> dict:
    """Every config's GPU time at one list width, on SETS position sets cycled in one graph."""
    dev = x["q"].device
    sets = []
    for _ in range(SETS):
        pos = torch.rand(B, HKV, CACHE // B, device=dev, generator=g).topk(width, dim=-1).indices
        sets.append(pos.sort(-1).values.to(torch.int32).contiguous())
    counts = torch.full((B, HKV), width, dtype=torch.int32, device=dev)
    # partials for the smallest BLOCK_L timed (group_workspace_numel sizes the space in force)
    splits = decode.split_count(width, min(c.kwargs["BLOCK_L"] for c in configs))
    ws = torch.zeros(B * HKV * (1 + splits * 16 * (D + 2)), dtype=torch.int32, device=dev)
    row = {"B": B, "width": width, "floor_us": B * HKV * width * (2 * D * 2 + 4) / gbps / 1e3, "configs": {}}
    for c in configs:
        fns = [
            lambda pos=pos, c=c: decode.group_decode(
                x["q"], x["k"], x["v"], pos, counts, out=x["out"], workspace=ws, config=c
            )
            for pos in sets
        ]
        try:
            graph = capture(fns, dev, calls=CALLS)
            row["configs"][name(c)] = time_graph(graph, dev, repeats=20, calls=CALLS)["median_us"]
            del graph
        except Exception as e:  # a config that does not compile at this shape
            row["configs"][name(c)] = None
            print(f"  {name(c)} at B{B} width {width}: {type(e).__name__}: {str(e)[:120]}")
    row["best_us"], row["best"] = min((t, n) for n, t in row["configs"].items() if t is not None)
    return row


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--json")
    p.add_argument("--candidates", action="store_true")
    p.add_argument("--batches", default="1,8")
    a = p.parse_args()
    dev = torch.device("cuda")
    gbps = copy_bandwidth(dev) / 1e9  # GB/s
    configs = CANDIDATES if a.candidates else decode.GROUP_DECODE_CONFIGS
    g = torch.Generator(device=dev).manual_seed(0)
    rows = []
    for B in (int(b) for b in a.batches.split(",")):
        x = {"k": torch.randn(B, HKV, CACHE // B, D, device=dev, generator=g, dtype=torch.bfloat16)}
        x["v"] = torch.randn_like(x["k"])
        x["q"] = torch.randn(B, H, D, device=dev, generator=g, dtype=torch.bfloat16)
        x["out"] = torch.empty_like(x["q"])
        for width in WIDTHS:
            if width <= CACHE // B:
                r = time_width(x, B, width, configs, gbps, g)
                rows.append(r)
                if a.json:
                    with open(a.json, "w") as f:
                        json.dump({"env": environment(dev), "copy_gbps": gbps, "rows": rows}, f, indent=1)
                cells = " ".join(f"{n}={t:.1f}" for n, t in r["configs"].items() if t is not None)
                ratio = r["best_us"] / r["floor_us"]
                print(
                    f"B{B} width {width}: floor {r['floor_us']:.1f} best {r['best']} {r['best_us']:.1f} "
                    f"({ratio:.2f}x) | {cells}",
                    flush=True,
                )
        del x
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
