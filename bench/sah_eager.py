"""Eager wall-clock of the sparse-attention-hub entry points at the original's benchmark shape.

The original's users call `indexer_next` and `sparse_attention` eagerly, one call after the other,
and read the result: each call here is timed from its start to a synchronize after it (wall
clock, the host's work and the GPU's together), and by CUDA events (GPU time). Shape: B=1,
H=32, Hkv=8, N=32000, D=128, float32 query and cache (the original's), M=2, 6 bits, sink,
window and heavy 128 (L=384), init_offset 128, one codebook (all but the newest key: one key
encoded a call) passed every call, as the original's benchmark does. Four input sets rotate
(their caches span far more than twice the L2). Beside them, dense SDPA over the whole cache
(no mask), the dense layer the user could run instead, and the bytes floor of each call at the
measured copy bandwidth.

Usage: PYTHONPATH=src python3 bench/sah_eager.py [--calls 300] [--json PATH] [--label NAME]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from pqattn import reference as ref
from pqattn.integrations.sparse_attention_hub import codebook_buffer, indexer_next, sparse_attention
from pqattn.lab.env import environment
from pqattn.lab.roofline import copy_gbps

B, H, HKV, N, D = 1, 32, 8, 32000, 128
M, BITS, SINK, WINDOW, HEAVY, IO = 2, 6, 128, 128, 128, 128
SETS = 4


def _inputs(seed: int) -> dict:
    g = torch.Generator(device="cuda").manual_seed(seed)
    C = 1 << BITS
    keys = torch.randn(B, HKV, N, D, device="cuda", generator=g)
    x = {
        "query": torch.randn(B, H, 1, D, device="cuda", generator=g),
        "key": keys,
        "value": torch.randn(B, HKV, N, D, device="cuda", generator=g),
        "centroids": torch.randn(B, HKV, M, C, D // M, device="cuda", generator=g),
    }
    codes = ref.encode(keys[:, :, IO : N - 1], x["centroids"], None, "euclidean")
    # all but the newest key, as a view of a buffer of indexer_next's own (as a call returns it)
    buf = codebook_buffer(codes.long().transpose(1, 2), IO, N - IO)[0]
    x["codebook"] = buf[:, IO : N - 1]
    return x


def _index(x: dict) -> tuple:
    opts = (torch.float32, SINK, WINDOW, HEAVY, M, BITS, 0, IO, "euclidean")
    return indexer_next(x["query"], x["key"], *opts, x["centroids"], x["codebook"], None)


def _time(fn: Callable[[dict], object], sets: list[dict], calls: int) -> dict:
    for i in range(10):
        fn(sets[i % SETS])
    torch.cuda.synchronize()
    wall, gpu = [], []
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for i in range(calls):
        x = sets[i % SETS]
        t0 = time.perf_counter()
        start.record()
        fn(x)
        end.record()
        torch.cuda.synchronize()
        wall.append((time.perf_counter() - t0) * 1e6)
        gpu.append(start.elapsed_time(end) * 1e3)
    return {"wall_us": statistics.median(wall), "gpu_us": statistics.median(gpu)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--calls", type=int, default=300, help="timed calls per row (default: 300)")
    p.add_argument("--json", help="write the rows and the environment here")
    p.add_argument("--label", default="", help="a name for this source tree in the JSON (default: none)")
    p.add_argument(
        "--profile", action="store_true", help="print torch.profiler's table of 20 calls of each entry point"
    )
    args = p.parse_args()
    sets = [_inputs(seed) for seed in range(SETS)]
    for x in sets:
        sparse_list, sparse_len, weights, *_ = _index(x)
        x["lists"] = (sparse_list, sparse_len, weights)
    L = SINK + WINDOW + HEAVY
    bandwidth = copy_gbps(torch.device("cuda"), 1 << 30) * 1e9
    fp32 = 4
    floors = {  # bytes each call must move
        "indexer_next": B * HKV * N * M * 8 + B * H * N * fp32 + B * H * L * 8,  # int64 codes, weights, list
        "sparse_attention": B * H * L * (2 * D * fp32 + 8 + fp32),  # K and V rows, position, weight
        "sdpa": 2 * B * HKV * N * D * fp32,
    }

    def attend(x: dict) -> torch.Tensor:
        return sparse_attention(x["query"][:, :, -1], x["key"], x["value"], *x["lists"])

    def sdpa(x: dict) -> torch.Tensor:
        return F.scaled_dot_product_attention(x["query"], x["key"], x["value"], enable_gqa=True)

    rows = {
        "indexer_next": _time(_index, sets, args.calls),
        "sparse_attention": _time(attend, sets, args.calls),
        "sdpa": _time(sdpa, sets, args.calls),
    }
    if args.profile:
        for name, fn in (("indexer_next", _index), ("sparse_attention", attend)):
            with torch.profiler.profile(
                activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
            ) as prof:
                for i in range(20):
                    fn(sets[i % SETS])
                    torch.cuda.synchronize()
            print(f"== {name}, 20 calls")
            print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=12))
    for name, row in rows.items():
        row["floor_us"] = floors[name] / bandwidth * 1e6
        row["share_of_floor"] = row["floor_us"] / row["gpu_us"]
    result = {
        "label": args.label,
        "shape": dict(B=B, H=H, Hkv=HKV, N=N, D=D, M=M, bits=BITS, sink=SINK, window=WINDOW, heavy=HEAVY),
        "dtype": "float32",
        "calls": args.calls,
        "input_sets": SETS,
        "copy_bandwidth_GBps": bandwidth / 1e9,
        "rows": rows,
        "env": environment(torch.device("cuda")),
    }
    print(f"{args.label or 'this tree'}: wall / GPU us per eager call (floor us)")
    for name, row in rows.items():
        print(f"  {name:18s} {row['wall_us']:8.1f} {row['gpu_us']:8.1f} ({row['floor_us']:.1f})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
