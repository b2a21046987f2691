"""Where transformers' eager `generate` spends a decode token: wall-clock against GPU time, per route
and cache, on the left-padded batch of `bench/left_padded_generate.py` (Llama-3-8B shapes, random
weights).

Per decode token, each figure is the difference between a `generate` of `--new` tokens and one of
2, divided by `--new` - 2 (the prefill, the index build and the first token cancel): the wall-clock
(median of `--samples` pairs, a sync after each call), the GPU time (the sum of the CUDA kernels'
durations under torch.profiler, one profiled pair) and the kernels launched. Wall-clock far above
GPU time means the host sets the pace: Python and launches, not the bytes.

Usage on the GPU machine: PYTHONPATH=src python3 bench/eager_generate_profile.py [--prompt 4096
    --batch 8 --new 12 --samples 3 --json PATH]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import transformers
from left_padded_generate import left_padded_batch
from torch.profiler import ProfilerActivity, profile

import pqattn.integrations.hf as pq_hf
from pqattn.lab.env import environment
from pqattn.lab.suites import LLAMA3_8B_LAYERS, llama_config


def _generate(model, ids: torch.Tensor, kw: dict, new: int) -> float:
    """One `generate` of `new` tokens, synced: its wall-clock in seconds."""
    start = time.perf_counter()
    model.generate(ids, max_new_tokens=new, **kw)
    torch.cuda.synchronize()
    return time.perf_counter() - start


def _kernels(model, ids: torch.Tensor, kw: dict, new: int) -> tuple[float, int]:
    """The CUDA kernels of one `generate` of `new` tokens: their summed duration (ms) and count."""
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        _generate(model, ids, kw, new)
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    return sum(e.time_range.end - e.time_range.start for e in kernels) / 1e3, len(kernels)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--prompt", type=int, default=4096)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--pad", type=float, default=0.5, help="the most-padded sequence's padding share")
    p.add_argument("--new", type=int, default=12)
    p.add_argument("--samples", type=int, default=3)
    p.add_argument("--density", type=float, default=0.02)
    p.add_argument("--json")
    a = p.parse_args()
    if a.new < 3:
        raise ValueError(f"--new: expected at least 3 tokens, got {a.new}")
    device = torch.device("cuda")
    cfg = llama_config(**LLAMA3_8B_LAYERS, max_positions=a.prompt + a.new)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).to(device=device, dtype=torch.bfloat16).eval()
    ids, mask = left_padded_batch(a, LLAMA3_8B_LAYERS["vocab"], device)
    layers = range(LLAMA3_8B_LAYERS["layers"])
    routes = {
        "pqattn": pq_hf.HFConfig(heavy_fraction=a.density, sink=64, window=64),
        "split-k": pq_hf.HFConfig(heavy_fraction=a.density, dense_layers=tuple(layers)),
        "sdpa": None,
    }
    rows = []
    decode = a.new - 2
    with torch.no_grad():
        for cache in ("dynamic", "static"):
            for route, config in routes.items():
                pq_hf.disable(model)
                if config is not None:
                    pq_hf.enable(model, config)
                kw = dict(attention_mask=mask, do_sample=False)
                if cache == "static":
                    kw["cache_implementation"] = "static"
                _generate(model, ids, kw, a.new)  # warm-up: compiles and tunes
                walls = [
                    (_generate(model, ids, kw, a.new) - _generate(model, ids, kw, 2)) * 1e3 / decode
                    for _ in range(a.samples)
                ]
                (gpu_new, n_new), (gpu_two, n_two) = (
                    _kernels(model, ids, kw, a.new),
                    _kernels(model, ids, kw, 2),
                )
                row = {
                    "route": route,
                    "cache": cache,
                    "wall_ms_a_token": statistics.median(walls),
                    "wall_samples_ms": walls,
                    "gpu_ms_a_token": (gpu_new - gpu_two) / decode,
                    "kernels_a_token": (n_new - n_two) / decode,
                }
                rows.append(row)
                print(
                    f"{route:8s} {cache:8s} wall {row['wall_ms_a_token']:6.2f} ms"
                    f"  GPU {row['gpu_ms_a_token']:5.2f} ms  {row['kernels_a_token']:6.1f} kernels a token",
                    flush=True,
                )
        pq_hf.disable(model)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"args": vars(a), "environment": environment(device), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
