"""A generate case's decode loops timed as `StaticDecoder.run()` steps them: back-to-back replays
of each loop's captured step, CUDA events around `--steps` steps (GPU time by graph replay),
beside the latency of one step followed by a sync (the suite's eager figure) and the profiler's
kernel time of one step.

Usage: PYTHONPATH=src python3 bench/loop_replay.py --case llama8L-B1-32K \
           --kinds split-compiled,pqattn-compiled [--steps 40] [--json PATH]
(kinds as the generate suite builds them: pqattn[-compiled], split[-compiled], dense[-compiled])
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from torch.profiler import ProfilerActivity, profile

from pqattn.lab import suites
from pqattn.lab.env import environment


def time_kind(x, kind: str, steps: int, rounds: int) -> dict:
    for _ in range(20):  # builds, prefills, captures, then warms the replays
        x.step(kind)
    torch.cuda.synchronize()
    replay = []
    for _ in range(rounds):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(steps):
            x.step(kind)
        end.record()
        torch.cuda.synchronize()
        replay.append(start.elapsed_time(end) * 1e3 / steps)
    latency = []
    for _ in range(10):
        t0 = time.perf_counter()
        x.step(kind)
        torch.cuda.synchronize()
        latency.append((time.perf_counter() - t0) * 1e6)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            x.step(kind)
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    return {
        "replay_us": statistics.median(replay),
        "replay_rounds_us": replay,
        "latency_us": statistics.median(latency),
        "kernels_us": sum(e.time_range.end - e.time_range.start for e in kernels) / 3,
        "launches": len(kernels) / 3,
    }


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--case", default="llama8L-B1-32K")
    p.add_argument("--kinds", default="split-compiled,pqattn-compiled")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--json")
    a = p.parse_args()
    dev = torch.device("cuda")
    case = next(c for c in suites.generate_suite("full", dev) if c.name == a.case)
    x = case.make_inputs(0)
    doc = {"env": environment(dev), "case": a.case, "params": case.params, "kinds": {}}
    for kind in a.kinds.split(","):
        doc["kinds"][kind] = r = time_kind(x, kind, a.steps, a.rounds)
        print(
            f"{a.case} {kind}: replay {r['replay_us']:.1f} us a step, latency {r['latency_us']:.1f}, "
            f"kernels {r['kernels_us']:.1f} ({r['launches']:.0f} launches)",
            flush=True,
        )
        if a.json:
            with open(a.json, "w") as f:
                json.dump(doc, f, indent=1)


if __name__ == "__main__":
    main()
