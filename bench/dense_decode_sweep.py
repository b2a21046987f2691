"""Dense decode over a static cache: `pqattn.ops.dense_decode` (the group decode kernel without
positions) against the same kernel fed every position (`ops.sparse_decode` over 0..count-1, the
dense route before it) and SDPA without a mask over exactly the counted tokens (a layer's best
dense figure; a captured loop cannot slice its cache per step), beside the bytes floor (the
counted K and V rows at the measured copy bandwidth). With --candidates, every config of
CANDIDATES forced as well.

Shapes are the generate suite's (H=32, Hkv=8, D=128, bf16; a cache of context + 512 slots, the
step at context + 1 tokens). Input sets rotate over more than twice the L2, in one graph.

Usage: PYTHONPATH=src python3 bench/dense_decode_sweep.py [--json PATH] [--candidates]
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F
import triton

from pqattn import ops
from pqattn.kernels import decode
from pqattn.lab.env import environment
from pqattn.lab.fidelity import copy_bandwidth
from pqattn.lab.timing import capture, time_graph

H, HKV, D, ROOM = 32, 8, 128, 512
SHAPES = ((1, 32768), (1, 131072), (8, 32768))
ROTATE_BYTES = 240 << 20  # above twice the H100's and the H200's L2
CANDIDATES = [
    triton.Config({"BLOCK_L": bl, "BLOCK_N": bn}, num_warps=w, num_stages=s)
    for bl, bn, w, s in (
        (512, 64, 4, 3),
        (1024, 64, 4, 3),
        (1024, 128, 8, 3),
        (2048, 64, 4, 2),
        (2048, 64, 8, 3),
        (4096, 64, 4, 2),
        (8192, 64, 4, 3),
    )
]


def name(c: triton.Config) -> str:
    return f"L{c.kwargs['BLOCK_L']}-N{c.kwargs['BLOCK_N']}-w{c.num_warps}-s{c.num_stages}"


def time_calls(fns: list, dev: torch.device) -> float:
    calls = 4 * len(fns)
    return time_graph(capture(fns, dev, calls=calls), dev, repeats=20, calls=calls)["median_us"]


def time_shape(B: int, context: int, configs: list, gbps: float, g: torch.Generator) -> dict:
    dev = torch.device("cuda")
    N, count = context + ROOM, context + 1
    sets = max(2, -(-ROTATE_BYTES // (2 * B * HKV * N * D * 2)))
    data = []
    for _ in range(sets):
        k = torch.randn(B, HKV, N, D, device=dev, generator=g, dtype=torch.bfloat16)
        q = torch.randn(B, H, D, device=dev, generator=g, dtype=torch.bfloat16)
        data.append((q, k, torch.randn_like(k)))
    counts = torch.full((B,), count, dtype=torch.int32, device=dev)
    per_head = torch.full((B, HKV), count, dtype=torch.int32, device=dev)
    positions = torch.arange(N, dtype=torch.int32, device=dev).expand(B, HKV, N).contiguous()
    ws = torch.zeros(ops.decode_workspace_numel(B * HKV, N, D, group=H // HKV), dtype=torch.int32, device=dev)
    out = torch.empty(B, H, D, dtype=torch.bfloat16, device=dev)
    floor = 2 * B * HKV * count * D * 2 / gbps / 1e3
    row = {"B": B, "context": context, "N": N, "count": count, "sets": sets, "floor_us": floor}
    row["gathered_us"] = time_calls(
        [lambda x=x: ops.sparse_decode(*x, positions, per_head, out=out, workspace=ws) for x in data], dev
    )
    row["dense_us"] = time_calls(
        [lambda x=x: ops.dense_decode(*x, counts, out=out, workspace=ws) for x in data], dev
    )
    want = ops.sparse_decode(*data[0], positions, per_head)
    got = ops.dense_decode(*data[0], counts)
    row["dense_max_diff"] = float((got.float() - want.float()).abs().max())
    row["sdpa_us"] = time_calls(
        [
            lambda q=q, k=k, v=v: F.scaled_dot_product_attention(
                q[:, :, None], k[:, :, :count], v[:, :, :count], enable_gqa=True
            )
            for q, k, v in data
        ],
        dev,
    )
    row["configs"] = {}
    for c in configs:
        fns = [
            lambda x=x, c=c: decode.group_decode(*x, None, per_head, out=out, workspace=ws, config=c)
            for x in data
        ]
        row["configs"][name(c)] = time_calls(fns, dev)
    return row


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--json")
    p.add_argument("--candidates", action="store_true")
    a = p.parse_args()
    dev = torch.device("cuda")
    gbps = copy_bandwidth(dev) / 1e9
    configs = decode.DENSE_DECODE_CONFIGS + (CANDIDATES if a.candidates else [])
    g = torch.Generator(device=dev).manual_seed(0)
    rows = []
    for B, context in SHAPES:
        r = time_shape(B, context, configs, gbps, g)
        rows.append(r)
        if a.json:
            with open(a.json, "w") as f:
                json.dump({"env": environment(dev), "copy_gbps": gbps, "rows": rows}, f, indent=1)
        times = {k: r[f"{k}_us"] for k in ("gathered", "dense", "sdpa")} | r["configs"]
        cells = " ".join(f"{n} {t:.1f} ({t / r['floor_us']:.2f}x)" for n, t in times.items())
        print(f"B{B} {context}: floor {r['floor_us']:.1f} us | {cells}", flush=True)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
