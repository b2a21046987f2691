"""Where the time of the user's layer step goes: `PQIndex.decode_step` (append + select + attend)
with the default policy, beside SDPA over the whole cache, each launch's GPU time, and the append
alone at several N (a cost that grows with N is a regression: the append must be O(1)).

Inputs rotate over enough sets (each its own index and caches) that no call finds its inputs in
L2: sized by the smaller side's bytes (`input_sets`), the sparse step's at B=1. Random centroids
and codes (speed only: the selection's work does not depend on the values).

Usage: PYTHONPATH=src python3 bench/step_profile.py [--shapes 1x32768,1x131072] [--room 8192] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import math
from collections import defaultdict

import torch

from pqattn import PQConfig, PQIndex
from pqattn.dispatch import PQCodebook
from pqattn.lab import baselines
from pqattn.lab.env import environment, l2_bytes
from pqattn.lab.timing import capture, sync, time_graph

H, HKV, D = 32, 8, 128
ROOM = 8192  # the capacity past N (every set is rewound to N before each timed replay)
CALLS = 16


def input_sets(B: int, N: int, config: PQConfig) -> int:
    """Input sets to rotate through so that neither side finds its inputs in L2: at least twice
    the L2 over the bytes the smaller side reads a call (the sparse step: the codes once per KV
    head and its selected K and V rows; SDPA: the whole cache), 2 to 8."""
    l2 = l2_bytes(torch.device("cuda"))
    rows = config.width(H // HKV) if config.share == "group" else config.width() * (H // HKV)
    sparse_bytes = B * HKV * (N * config.subvectors + rows * 2 * D * 2)
    kv_bytes = 2 * B * HKV * N * D * 2
    return max(2, min(8, math.ceil(2 * l2 / min(sparse_bytes, kv_bytes))))


def make_index(B: int, N: int, config: PQConfig, g: torch.Generator, room: int = ROOM) -> PQIndex:
    M, C = config.subvectors, 1 << config.bits
    cent = torch.randn(B, HKV, M, C, D // M, device="cuda", generator=g)
    codes = torch.randint(0, C, (B, HKV, N, M), device="cuda", generator=g, dtype=torch.uint8)
    return PQIndex.from_codebook(PQCodebook(cent, codes, None), [N] * B, capacity=N + room, config=config)


def kernel_profile(fns, steps: int = 40) -> dict[str, float]:
    """Mean GPU microseconds per call of each kernel name over eager calls."""
    for f in fns:
        f()
    sync(torch.device("cuda"))
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for i in range(steps):
            fns[i % len(fns)]()
        sync(torch.device("cuda"))
    total: dict[str, float] = defaultdict(float)
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            total[e.name] += e.device_time_total if hasattr(e, "device_time_total") else e.cuda_time_total
    return {k: v / steps for k, v in sorted(total.items(), key=lambda kv: -kv[1])}


def run_shape(B: int, N: int, density: float, subvectors: int, bits: int, room: int = ROOM) -> dict:
    g = torch.Generator(device="cuda").manual_seed(B * 1000 + N)
    config = PQConfig(subvectors=subvectors, bits=bits, sink=64, window=64, heavy=max(1, round(density * N)))
    sets = input_sets(B, N, config)
    dt = torch.bfloat16
    xs = []
    for _ in range(sets):
        cap = N + room
        x = {
            "index": make_index(B, N, config, g, room),
            "kc": torch.randn(B, HKV, cap, D, device="cuda", generator=g).to(dt),
            "vc": torch.randn(B, HKV, cap, D, device="cuda", generator=g).to(dt),
            "q": torch.randn(B, H, D, device="cuda", generator=g).to(dt),
            "kn": torch.randn(B, HKV, 1, D, device="cuda", generator=g).to(dt),
            "vn": torch.randn(B, HKV, 1, D, device="cuda", generator=g).to(dt),
        }
        x["k"], x["v"] = x["kc"][:, :, :N].contiguous(), x["vc"][:, :, :N].contiguous()
        xs.append(x)
    dev = torch.device("cuda")

    def step(x):
        return lambda: x["index"].decode_step(x["q"], x["kn"], x["vn"], x["kc"], x["vc"])

    def append(x):
        return lambda: x["index"].append(x["kn"])

    def sdpa(x):
        return lambda: baselines.sdpa_decode(x["q"], x["k"], x["v"])

    def rewind() -> None:  # every set back to N tokens (outside the timed replays)
        for x in xs:
            x["index"].truncate([N] * B)

    row = {"B": B, "N": N, "M": config.subvectors, "bits": config.bits, "heavy": config.heavy, "sets": sets}
    row["capacity"] = N + room
    for name, make in (("step", step), ("append", append), ("sdpa", sdpa)):
        fns = [make(x) for x in xs]
        rewind()
        graph = capture(fns, dev, calls=CALLS)
        row[name + "_us"] = time_graph(graph, dev, repeats=20, calls=CALLS, between=rewind)["median_us"]
        del graph
    rewind()
    row["kernels_us"] = kernel_profile([step(x) for x in xs])
    row["step_vs_sdpa"] = row["sdpa_us"] / row["step_us"]
    return row


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--shapes", default="1x4096,1x32768,1x131072,8x32768,1x524288")
    p.add_argument("--density", type=float, default=0.02)
    p.add_argument("--subvectors", type=int, default=PQConfig.subvectors)
    p.add_argument("--bits", type=int, default=PQConfig.bits)
    p.add_argument("--room", type=int, default=ROOM, help="the capacity past N (at least one replay's calls)")
    p.add_argument("--json")
    a = p.parse_args()
    rows = []
    for s in a.shapes.split(","):
        B, N = (int(v) for v in s.split("x"))
        rows.append(run_shape(B, N, a.density, a.subvectors, a.bits, a.room))
        r = rows[-1]
        top = ", ".join(f"{k[:40]} {v:.1f}" for k, v in list(r["kernels_us"].items())[:6])
        print(
            f"B{B} N{N}: step {r['step_us']:.1f} us, append {r['append_us']:.1f}, sdpa {r['sdpa_us']:.1f} "
            f"({r['step_vs_sdpa']:.2f}x) | {top}",
            flush=True,
        )
        torch.cuda.empty_cache()
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"env": environment(torch.device("cuda")), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
