"""The eager floor of a GPU host: what one call + sync costs before any Python of ours.

Timed as the bench times eager calls (`pqattn.lab.timing.time_eager`: one call, then a sync, per
sample; medians of 2000 samples, three rounds): an empty call; one launch of a trivial Triton
kernel through `pqattn.runtime.launch.Launcher`; the three output tensors of the original's
entry point at its benchmark shape (`indexer_next` returns fresh ones); a kernel that spins the
GPU for the selection's GPU time (torch.cuda._sleep, calibrated, launched from C++), alone and
after those allocations. Beside them, the two selection calls at that shape: `PQIndex.select`
(one launch from a recorded plan) and `indexer_next` (the select suite's `compat`). The spin's
GPU time is measured by graph replay.

The compat call's eager target (30 us) leaves, after "3 allocations + spin", what its own Python
may take; the native one (20 us), after "spin" at the native GPU time.

Usage on the GPU machine: PYTHONPATH=src python3 bench/eager_floor.py [--gpu-us 14.2] [--json PATH]
"""

from __future__ import annotations

import argparse
import json

import torch
import triton
import triton.language as tl

from pqattn.lab import env, suites, timing
from pqattn.runtime.launch import Launcher


@triton.jit
def _touch(out_ptr, v, BLOCK: tl.constexpr):
    tl.store(out_ptr + tl.arange(0, BLOCK), tl.zeros([BLOCK], tl.int32) + v)


def _spin_cycles(us: float) -> int:
    """torch.cuda._sleep's argument for `us` microseconds, from a warm 1M-cycle spin."""
    for _ in range(3):
        torch.cuda._sleep(1_000_000)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(1_000_000)
    end.record()
    torch.cuda.synchronize()
    return int(us * 1_000_000 / (start.elapsed_time(end) * 1000))


def _graph_us(fn, calls: int = 20) -> float:
    graph = timing.capture([fn], torch.device("cuda"), calls=calls)
    return timing.time_graph(graph, torch.device("cuda"), repeats=20, calls=calls)["median_us"]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--gpu-us", type=float, default=14.2, help="GPU time the spin kernel takes")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--json")
    args = p.parse_args()
    dev = torch.device("cuda")

    flag = torch.zeros(128, dtype=torch.int32, device=dev)
    touch = Launcher(_touch)
    case = next(c for c in suites.select_suite("quick", dev) if c.name == "original")
    x = case.make_inputs(0)
    B, H, N = x["key"].shape[0], x["q"].shape[1], x["key"].shape[2]
    L = case.params["sink"] + case.params["heavy"] + case.params["window"]
    cycles = _spin_cycles(args.gpu_us)

    def outputs() -> tuple:  # indexer_next's sparse_list, sparse_len, weight_list
        return (
            torch.empty(B, H, L, dtype=torch.int64, device=dev),
            torch.empty(B, H, dtype=torch.int64, device=dev),
            torch.empty(B, H, N, dtype=torch.float32, device=dev),
        )

    calls = {
        "empty call": lambda: None,
        "one trivial launch (Launcher)": lambda: touch((1,), (flag,), (3,), {"BLOCK": 128}),
        "3 output allocations": outputs,
        "3 output allocations + trivial launch": lambda: (
            outputs(),
            touch((1,), (flag,), (3,), {"BLOCK": 128}),
        ),
        "spin": lambda: torch.cuda._sleep(cycles),
        "3 output allocations + spin": lambda: (outputs(), torch.cuda._sleep(cycles)),
        "PQIndex.select": lambda: x["index"].select(x["q"]),
        "indexer_next (compat)": lambda: x["compat"](x["codebook"]),
    }
    eager: dict[str, list[float]] = {}
    for _ in range(args.rounds):
        for name, fn in calls.items():
            for _ in range(20):
                fn()
            median = timing.time_eager([fn], dev, repeats=2000)["median_us"]
            eager.setdefault(name, []).append(round(median, 1))
    gpu = {
        "spin": round(_graph_us(lambda: torch.cuda._sleep(cycles)), 2),
        "PQIndex.select": round(_graph_us(lambda: x["index"].select(x["q"])), 2),
    }
    for name, us in eager.items():
        print(f"{name:40s} eager with a sync: {us} us", flush=True)
    print(f"GPU time by graph replay: {gpu}")
    if args.json:
        doc = {
            "what": "eager floor: one call + sync, medians of 2000 samples per round (us)",
            "shape": case.params,
            "environment": env.environment(dev),
            "eager_us": eager,
            "gpu_us": gpu,
        }
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=1)


if __name__ == "__main__":
    main()
