"""Whether a layer's o_proj weights can stream into the L2 while the sparse layer step runs (its
launches are latency-bound at small batch, the memory mostly idle), so that the projection after
it reads them from the L2: a kernel-figure probe, not a path users call.

Per layer (8 layers, each its own index, caches and o_proj weight [4096, 4096] bfloat16): the
step (`PQIndex.decode_step`, default policy) then the o_proj product of B tokens; with the weight
first read on a side stream by a kernel of loads kept in the L2 (`evict_last`, 264 programs), or
prefetched by `cp.async.bulk.prefetch.L2` chunks (16 or 64 KiB each) on the main stream. GPU time
a layer by graph replay, the indexes rolled back between replays.

Usage: PYTHONPATH=src python3 bench/l2_prefetch_probe.py [--json PATH]
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from step_profile import HKV, D, H, make_index

from pqattn import PQConfig
from pqattn.lab.env import environment
from pqattn.lab.timing import capture, time_graph

LAYERS = 8
MODES = ("step_only", "linear_only", "none", "side_evict_last", "bulk16", "bulk64", "none_again")


@triton.jit
def _touch_kernel(w_ptr, out_ptr, n, BLOCK: tl.constexpr):
    """Read w[:n] with `evict_last` (kept in the L2), a sum a program so that the loads stay."""
    acc = tl.zeros([BLOCK], tl.float32)
    for i in range(tl.program_id(0) * BLOCK, n, tl.num_programs(0) * BLOCK):
        offs = i + tl.arange(0, BLOCK)
        acc += tl.load(w_ptr + offs, mask=offs < n, other=0.0, eviction_policy="evict_last").to(tl.float32)
    tl.store(out_ptr + tl.program_id(0), tl.sum(acc))


@triton.jit
def _bulk_prefetch_kernel(w_ptr, CHUNK: tl.constexpr):
    """128 chunks of CHUNK bytes a program, each one `cp.async.bulk.prefetch.L2` by a thread."""
    i = tl.program_id(0) * 128 + tl.arange(0, 128)
    tl.inline_asm_elementwise(
        "cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0;",
        "=r,l,r",
        [w_ptr + i.to(tl.int64) * (CHUNK // 2), tl.full([128], CHUNK, tl.int32)],
        dtype=tl.int32,
        is_pure=False,
        pack=1,
    )


def run_shape(B: int, N: int, g: torch.Generator, dev: torch.device) -> dict:
    config, room = PQConfig(sink=64, window=64, heavy=round(0.02 * N)), 256
    layers = []
    for _ in range(LAYERS):
        x = {n: torch.randn(B, HKV, N + room, D, device=dev, generator=g).bfloat16() for n in ("kc", "vc")}
        x |= {n: torch.randn(B, HKV, 1, D, device=dev, generator=g).bfloat16() for n in ("kn", "vn")}
        x["index"] = make_index(B, N, config, g, room)
        x["q"] = torch.randn(B, H, D, device=dev, generator=g).bfloat16()
        x["w"] = torch.randn(4096, 4096, device=dev, generator=g).bfloat16()
        x["xo"] = torch.randn(B, 4096, device=dev, generator=g).bfloat16()
        layers.append(x)
    sums, side = torch.empty(264, device=dev), torch.cuda.Stream(dev)

    def rewind() -> None:
        for x in layers:
            x["index"].truncate([N] * B)

    def forward(mode: str):
        def f() -> None:
            for x in layers:
                if mode == "side_evict_last":
                    side.wait_stream(torch.cuda.current_stream())
                    with torch.cuda.stream(side):
                        _touch_kernel[(264,)](x["w"], sums, x["w"].numel(), 2048, num_warps=4)
                elif mode.startswith("bulk"):
                    chunk = int(mode[4:]) * 1024
                    _bulk_prefetch_kernel[(x["w"].numel() * 2 // chunk // 128,)](x["w"], chunk, num_warps=4)
                if mode != "linear_only":
                    x["index"].decode_step(x["q"], x["kn"], x["vn"], x["kc"], x["vc"])
                if mode == "side_evict_last":
                    torch.cuda.current_stream().wait_stream(side)
                if mode != "step_only":
                    F.linear(x["xo"], x["w"])

        return f

    row = {"B": B, "N": N, "layers": LAYERS}
    for mode in MODES:
        rewind()
        graph = capture([forward(mode.removesuffix("_again"))], dev, calls=1)
        row[mode + "_us"] = time_graph(graph, dev, repeats=20, calls=1, between=rewind)["median_us"] / LAYERS
        del graph
    return row


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--json")
    a = p.parse_args()
    dev = torch.device("cuda")
    g = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    for B, N in ((1, 32768), (8, 32768)):
        rows.append(run_shape(B, N, g, dev))
        times = ", ".join(f"{m} {rows[-1][m + '_us']:.1f}" for m in MODES)
        print(f"B{B} N{N}: {times} us a layer", flush=True)
        torch.cuda.empty_cache()
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"env": environment(dev), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
