"""Time every config of the selection kernel's autotune space at a few shapes (GPU time, graph replay).

Usage on the GPU machine: PYTHONPATH=src python3 bench/select_configs.py [--json PATH]
"""

from __future__ import annotations

import argparse
import functools
import json

import torch

from pqattn import reference as ref
from pqattn.kernels.select.tree import configs_for, pq_select, workspace_numel
from pqattn.lab import timing

SHAPES = [  # B, H, Hkv, N, heavy
    (1, 32, 32, 32000, 128),
    (1, 32, 8, 524288, 128),
    (8, 32, 8, 131072, 1024),
    (32, 32, 8, 32768, 2048),
    (32, 32, 8, 524288, 2048),
]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--json")
    args = p.parse_args()
    dev = torch.device("cuda")
    rows = []
    for B, H, Hkv, N, heavy in SHAPES:
        M, C, D, sink, window = 2, 64, 128, 128, 128
        q = torch.randn(B, H, D, device=dev)
        cent = torch.randn(B, Hkv, M, C, D // M, device=dev)
        codes = torch.randint(0, C, (B, Hkv, N, M), device=dev, dtype=torch.uint8)
        lens = torch.full((B,), N, device=dev, dtype=torch.int32)
        params = ref.SelectParams.make(
            sink=sink,
            window=window,
            heavy=heavy,
            cand_lo=sink,
            short_threshold=sink + heavy + window,
            n_tokens=N,
        )
        width = params.width
        pos = torch.empty(B, H, width, dtype=torch.int32, device=dev)
        cnt = torch.empty(B, H, dtype=torch.int32, device=dev)
        ws = torch.zeros(workspace_numel(B * H, M, C, N, heavy), dtype=torch.int32, device=dev)
        kw = dict(
            positions=pos,
            counts=cnt,
            workspace=ws,
            n_tokens=N,
        )
        for cfg in configs_for(heavy, N):
            call = functools.partial(pq_select, q, cent, codes, lens, params, **kw, config=cfg)
            call()
            graph = timing.capture([call], dev, calls=10)
            t = timing.time_graph(graph, dev, repeats=20, calls=10)
            rows.append(
                {
                    "shape": [B, H, Hkv, N, heavy],
                    "config": {**cfg.kwargs, "num_warps": cfg.num_warps, "maxnreg": cfg.maxnreg},
                    "median_us": t["median_us"],
                }
            )
            print(
                f"B{B} H{H} N{N} heavy{heavy} {cfg.kwargs} w{cfg.num_warps}: {t['median_us']:.1f} us",
                flush=True,
            )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
