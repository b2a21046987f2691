"""Tensor-parallel greedy generation with pqattn: transformers' `tp_plan="auto"` under torchrun.

Each rank holds its attention heads' share of the KV cache and its own PQ index per layer;
prefill, index build, selection and sparse decode run per rank and add no collective of their
own. Runs dense (SDPA) and then pqattn on the same weights, each through transformers'
`generate` (a dynamic cache) and through `pqattn.integrations.hf.generate` (a static cache, the
decode step captured as a CUDA graph on GPUs), and reports the greedy tokens, tokens per second
of `generate` and milliseconds per token of the static loop's decode steps (rank 0 writes the
JSON). Wall-clock with a sync, one sample each.

Usage:
    torchrun --nproc-per-node N bench/tp_generate.py --model PATH [--prompt 32768 --batch 8
        --new 64 --heavy 1024 --json PATH]
    torchrun --nproc-per-node N bench/tp_generate.py --save-random PATH   # a Llama-3-8B-shaped
        8-layer checkpoint with random weights (once, on one process: plain python works too)
CPUs run it with the gloo backend (the tests do, on a tiny model); GPUs with NCCL (keep
NCCL_NVLS_ENABLE=0).
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
import transformers

import pqattn.integrations.hf as pq_hf
from pqattn.lab.suites import LLAMA3_8B_LAYERS, llama_config


def _save_random(path: str) -> None:
    cfg = llama_config(**LLAMA3_8B_LAYERS, max_positions=140_000)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(cfg).to(torch.bfloat16).save_pretrained(path)


def _timed(fn) -> tuple[torch.Tensor, float]:
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    start = time.perf_counter()
    out = fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return out, time.perf_counter() - start


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", help="a local checkpoint folder")
    p.add_argument("--save-random", metavar="PATH", help="write the random 8-layer checkpoint and exit")
    p.add_argument("--prompt", type=int, default=32768, help="prompt tokens per sequence")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--new", type=int, default=64, help="generated tokens per sequence")
    p.add_argument("--heavy", type=int, default=1024)
    p.add_argument("--sink", type=int, default=128)
    p.add_argument("--window", type=int, default=128)
    p.add_argument("--bits", type=int, default=6)
    p.add_argument("--json", metavar="PATH")
    args = p.parse_args()
    if args.save_random:
        _save_random(args.save_random)
        return
    dtype = torch.bfloat16 if torch.cuda.is_available() else torch.float32
    model = transformers.AutoModelForCausalLM.from_pretrained(args.model, tp_plan="auto", dtype=dtype).eval()
    rank = int(os.environ.get("RANK", 0))
    world = int(os.environ.get("WORLD_SIZE", 1))
    vocab = model.config.vocab_size
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (args.batch, args.prompt), generator=gen).to(model.device)
    config = pq_hf.HFConfig(
        heavy=args.heavy, sink=args.sink, window=args.window, bits=args.bits, capacity=args.new + 8
    )
    doc: dict = {"world_size": world, "prompt": args.prompt, "batch": args.batch, "new": args.new}
    doc["device"] = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    for kind in ("dense", "pqattn"):
        if kind == "pqattn":
            pq_hf.enable(model, config)
        with torch.no_grad():
            mask = torch.ones_like(ids)
            dynamic, t_dynamic = _timed(
                lambda m=mask: model.generate(ids, attention_mask=m, max_new_tokens=args.new, do_sample=False)
            )
        pq_hf.generate(model, ids, 2)  # compiles, autotunes, captures once
        _, t_two = _timed(lambda: pq_hf.generate(model, ids, 2))
        static, t_static = _timed(lambda: pq_hf.generate(model, ids, args.new))
        states = [m._pqattn_state for m in model.modules() if getattr(m, "_pqattn_state", None) is not None]
        doc[kind] = {
            "dynamic_tokens": dynamic[:, args.prompt :].tolist(),
            "static_tokens": static[:, args.prompt :].tolist(),
            "dynamic_tokens_per_s": args.batch * args.new / t_dynamic,
            # the static loop's decode steps: the call less one of two tokens (prefill, capture)
            "static_ms_per_token": (t_static - t_two) / max(args.new - 2, 1) * 1e3,
            "index_kv_heads": states[0].index.kv_heads if states else None,
        }
        if rank == 0:
            print(kind, {k: v for k, v in doc[kind].items() if "_per_" in k}, flush=True)
    if rank == 0 and args.json:
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=1)


if __name__ == "__main__":
    main()
