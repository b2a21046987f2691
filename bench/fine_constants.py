"""The user's layer step (`PQIndex.decode_step`, default policy) under module constants of the fine
selection route (`pqattn.kernels.select.fine`), each config on the same inputs in one process, in
the order given (repeat a config to see the drift between rounds).

Per shape the inputs (indexes and caches, rotating past the L2 as in `bench/step_profile.py`) are
built once; per config the constants are set, the indexes rolled back to N tokens and their kept
launches dropped (a kept plan replays the launches recorded under the former constants), then the
step is timed by graph replay and its kernels by the profiler.

Usage: PYTHONPATH=src python3 bench/fine_constants.py --shapes 8x32768,32x32768 \
    --config base= --config lut2k=LUT_PROGRAM_ELEMENTS=2048 --config base2= [--json PATH]
"""

from __future__ import annotations

import argparse
import json

import torch
from step_profile import CALLS, HKV, ROOM, D, H, input_sets, kernel_profile, make_index

from pqattn import PQConfig
from pqattn.kernels.select import fine
from pqattn.lab.env import environment
from pqattn.lab.timing import capture, time_graph
from pqattn.runtime.launch import PlanCache


def parse_config(text: str) -> tuple[str, dict[str, int]]:
    """'name=K=V,K=V' (or 'name=' for the module's own values) -> (name, {K: V})."""
    name, _, rest = text.partition("=")
    patch = {}
    for item in filter(None, rest.split(",")):
        key, _, value = item.partition("=")
        if not hasattr(fine, key):
            raise ValueError(f"--config: pqattn.kernels.select.fine has no constant {key!r}")
        patch[key] = int(value)
    return name, patch


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--shapes", default="1x32768,8x32768,32x32768,1x131072")
    p.add_argument("--config", action="append", required=True, help="name=K=V[,K=V]; 'name=': the defaults")
    p.add_argument("--json")
    a = p.parse_args()
    configs = [parse_config(c) for c in a.config]
    defaults = {k: getattr(fine, k) for _, patch in configs for k in patch}
    dev = torch.device("cuda")
    rows = []
    for s in a.shapes.split(","):
        B, N = (int(v) for v in s.split("x"))
        g = torch.Generator(device="cuda").manual_seed(B * 1000 + N)
        config = PQConfig(sink=64, window=64, heavy=round(0.02 * N))
        sets = input_sets(B, N, config)
        xs = []
        for _ in range(sets):
            x = {"index": make_index(B, N, config, g)}
            for name, n in (("kc", N + ROOM), ("vc", N + ROOM), ("kn", 1), ("vn", 1)):
                x[name] = torch.randn(B, HKV, n, D, device="cuda", generator=g).bfloat16()
            x["q"] = torch.randn(B, H, D, device="cuda", generator=g).bfloat16()
            xs.append(x)

        def step(x):
            return lambda: x["index"].decode_step(x["q"], x["kn"], x["vn"], x["kc"], x["vc"])

        for name, patch in configs:
            for k, v in defaults.items():
                setattr(fine, k, patch.get(k, v))
            for x in xs:
                x["index"].truncate([N] * B)
                x["index"]._plans = PlanCache(x["index"]._plans.size)  # re-recorded under the constants
            fns = [step(x) for x in xs]
            for f in fns:
                f()
            graph = capture(fns, dev, calls=CALLS)
            us = time_graph(graph, dev, repeats=20, calls=CALLS)["median_us"]
            del graph
            for x in xs:
                x["index"].sync_lengths()
            kernels = kernel_profile([step(x) for x in xs])
            row = {"B": B, "N": N, "config": name, "patch": patch, "step_us": us, "kernels_us": kernels}
            rows.append(row)
            top = " ".join(f"{k.strip('_')[:12]} {v:.1f}" for k, v in list(kernels.items())[:5])
            print(f"B{B} N{N} {name:8s} step {us:6.1f} us | {top}", flush=True)
        for k, v in defaults.items():
            setattr(fine, k, v)
        del xs
        torch.cuda.empty_cache()
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"env": environment(dev), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
