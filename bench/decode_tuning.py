"""The group decode's autotuner: the config it picks and its timings per tuning method, beside the
user's layer step (`PQIndex.decode_step`, default policy, bench/step_profile.py) it then runs.

Methods: `in-force` (the module's: graph replay, interleaved rounds), `flush` (Triton's default:
single timed calls after an L2 flush, one round), `flush-rounds` (the same, five rounds of 5 / 20
ms), `graph` (graph replay, one round), `force<i>` (GROUP_DECODE_CONFIGS[i] alone, untimed). Run
each method in a fresh process: the tuner keeps its choices for the process's life.

Usage: PYTHONPATH=src python3 bench/decode_tuning.py --method in-force [--shapes 1x32768,8x32768]
       [--room 8192] [--json PATH (a line of JSON per shape appended)]
"""

from __future__ import annotations

import argparse
import json

import step_profile
import torch
import triton

from pqattn import PQConfig
from pqattn.kernels import decode
from pqattn.lab.env import environment
from pqattn.runtime.launch import graph_timing

METHODS = {  # name: (rounds, the timing of one config)
    "flush": (1, lambda fn, quantiles: triton.testing.do_bench(fn, quantiles=quantiles)),
    "flush-rounds": (
        5,
        lambda fn, quantiles: triton.testing.do_bench(fn, warmup=5, rep=20, quantiles=quantiles),
    ),
    "graph": (1, graph_timing(rep=100)),
}


def set_method(autotuned: triton.runtime.Autotuner, tuned, method: str) -> None:
    """Point the autotuner (and its TunedLauncher's rounds) at one tuning method. `_do_bench` is
    where Triton's Autotuner keeps its timing function."""
    if method in METHODS:
        tuned.rounds, autotuned._do_bench = METHODS[method]
    elif method.startswith("force"):
        autotuned.configs = [decode.GROUP_DECODE_CONFIGS[int(method[5:])]]
    elif method != "in-force":
        raise ValueError(f"--method: expected in-force, {', '.join(METHODS)} or force<i>, got {method!r}")


def name(config: triton.Config) -> str:
    return f"{config.kwargs['BLOCK_L']}/{config.kwargs['BLOCK_N']}/{config.num_warps}"


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--method", default="in-force")
    p.add_argument("--shapes", default="1x8192,1x32768,8x32768,32x32768,1x131072")
    p.add_argument("--room", type=int, default=step_profile.ROOM)
    p.add_argument("--json")
    a = p.parse_args()
    autotuned, tuned = decode.group_decode_autotuned, decode.group_decode_tuned
    set_method(autotuned, tuned, a.method)
    timings: list[float] = []
    bench = autotuned._do_bench  # set by decode.py or set_method; `do_bench` caches on first read

    def timed(fn, quantiles):
        t = bench(fn, quantiles)
        timings.append(round(t[0] * 1000, 2))
        return t

    autotuned._do_bench = timed
    env = environment(torch.device("cuda"))
    for shape in a.shapes.split(","):
        B, N = (int(v) for v in shape.split("x"))
        first = len(timings)
        row = step_profile.run_shape(B, N, 0.02, PQConfig.subvectors, PQConfig.bits, a.room)
        out = {
            "method": a.method,
            "B": B,
            "N": N,
            "room": a.room,
            "step_us": row["step_us"],
            "group_decode_us": row["kernels_us"].get("_group_decode_kernel"),
            "picked": name(list(tuned.chosen.values())[-1][0]),
            # per round, one time per config of the space in its order (entries/rows/warps)
            "tuning_us": timings[first:],
            "space": [name(c) for c in autotuned.configs],
        }
        print(json.dumps(out), flush=True)
        if a.json:
            with open(a.json, "a") as f:
                f.write(json.dumps(out | {"env": env}) + "\n")
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
