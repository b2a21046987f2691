"""Per-token time of the static decode loop (`pqattn.integrations.hf.generate`), dense against
pqattn, on a Llama-3-8B-shaped model of 8 layers with random weights (bf16, B=1, a 32K prompt).

The loop is timed end to end with a sync: generate(72 tokens) minus generate(8 tokens), divided
by the 64 tokens between them, after two warm-up calls (compilation, autotuning, graph capture).
The dense baseline is the same loop with SDPA. A preliminary figure until `pqattn bench generate`
times this loop with its repeated samples (issue 41).

Usage (on a GPU): PYTHONPATH=src python3 bench/generate_static.py [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import transformers

import pqattn.integrations.hf as pq_hf
from pqattn.lab.suites import LLAMA3_8B_LAYERS, llama_config


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--json")
    p.add_argument("--tokens", type=int, default=32768, help="prompt length")
    args = p.parse_args()
    cfg = llama_config(**LLAMA3_8B_LAYERS, max_positions=args.tokens + 1024)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = transformers.LlamaForCausalLM(cfg).to(torch.bfloat16).eval()
    ids = torch.randint(0, 32000, (1, args.tokens), device="cuda")

    def seconds(n: int) -> float:
        torch.cuda.synchronize()
        start = time.perf_counter()
        pq_hf.generate(model, ids, n)
        torch.cuda.synchronize()
        return time.perf_counter() - start

    doc = {"device": torch.cuda.get_device_name(), "tokens": args.tokens, "layers": 8, "batch": 1}
    for kind in ("dense", "pqattn"):
        if kind == "pqattn":
            pq_hf.enable(model, pq_hf.HFConfig(heavy=1024, sink=128, window=128))
        seconds(4)
        seconds(8)
        short, long = seconds(8), seconds(72)
        doc[kind] = {"ms_per_token": (long - short) / 64 * 1e3, "t8_s": short, "t72_s": long}
        print(kind, doc[kind], flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=1)


if __name__ == "__main__":
    main()
