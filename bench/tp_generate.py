"""Tensor-parallel greedy generation with pqattn: transformers' `tp_plan="auto"` under torchrun.

Each rank holds its attention heads' share of the KV cache and its own PQ index per layer;
prefill, index build, selection and sparse decode run per rank and add no collective of their
own. Runs dense (SDPA) and then pqattn on the same weights, each through transformers'
`generate` (a dynamic cache) and through `pqattn.integrations.hf.generate` (a static cache, the
decode step captured as a CUDA graph on GPUs), and reports the greedy tokens, tokens per second
of `generate` and milliseconds per token of the static loop's decode steps, with `--compile`
also those of the loop whose decode forward runs through torch.compile (rank 0 writes the
JSON). Wall-clock with a sync: `generate` once; the static loop's replayed steps in `samples`
samples of `steps` steps each (median reported).

Usage:
    torchrun --nproc-per-node N bench/tp_generate.py --model PATH [--prompt 32768 --batch 8
        --new 64 --samples 5 --steps 16 --profile --json PATH]   # the default policy at 2% per head
    torchrun --nproc-per-node N bench/tp_generate.py --save-random PATH   # a Llama-3-8B-shaped
        8-layer checkpoint with random weights (once, on one process: plain python works too)
CPUs run it with the gloo backend (the tests do, on a tiny model); GPUs with NCCL (keep
NCCL_NVLS_ENABLE=0).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch
import transformers

import pqattn.integrations.hf as pq_hf
from pqattn.integrations import tensor_parallel
from pqattn.lab.bench import profile_calls
from pqattn.lab.env import environment
from pqattn.lab.suites import LLAMA3_8B_LAYERS, llama_config


def _save_random(path: str) -> None:
    cfg = llama_config(**LLAMA3_8B_LAYERS, max_positions=140_000)
    torch.manual_seed(0)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = transformers.LlamaForCausalLM(cfg).to(torch.bfloat16)
    model.save_pretrained(path)


def _timed(fn) -> tuple[torch.Tensor, float]:
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    start = time.perf_counter()
    out = fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return out, time.perf_counter() - start


PROFILED_STEPS = 5


def _static_samples(
    model, ids: torch.Tensor, samples: int, steps: int, *, compile: bool, profile: bool = False
) -> tuple[list[float], list, dict | None]:
    """(ms per token of the static loop's replayed steps, its greedy tokens, rank 0's profile of
    PROFILED_STEPS more steps with `profile`): eager (and compiling), capture, a first replay,
    then `samples` x `steps` timed. Every rank steps; rank 0 alone runs the profiler."""
    extra = PROFILED_STEPS if profile else 0
    decoder = pq_hf.StaticDecoder(model, ids, 4 + samples * steps + extra, compile=compile)  # + prefill's
    for _ in range(3):
        decoder.step()
    out = []
    for _ in range(samples):
        _, seconds = _timed(lambda d=decoder: [d.step() for _ in range(steps)])
        out.append(seconds / steps * 1e3)
    tokens = decoder.tokens[:, : 4 + samples * steps].tolist()
    prof = None
    if profile and int(os.environ.get("RANK", 0)) == 0:
        prof = profile_calls([decoder.step], ids.device, calls=PROFILED_STEPS)
    elif profile:
        for _ in range(PROFILED_STEPS):
            decoder.step()
    return out, tokens, prof


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", help="a local checkpoint folder")
    p.add_argument("--save-random", metavar="PATH", help="write the random 8-layer checkpoint and exit")
    p.add_argument("--prompt", type=int, default=32768, help="prompt tokens per sequence")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--new", type=int, default=64, help="generated tokens per sequence")
    # the selection policy: HFConfig's defaults where not given, heavy 2% of the prompt per head
    p.add_argument("--heavy", type=int, help="heavy tokens per query head (default: --heavy-fraction)")
    p.add_argument("--heavy-fraction", type=float, default=0.02)
    p.add_argument("--sink", type=int)
    p.add_argument("--window", type=int)
    p.add_argument("--bits", type=int)
    p.add_argument("--subvectors", type=int)
    p.add_argument("--share", choices=["head", "group"], help="per-head or group selection")
    p.add_argument("--group-rule", choices=["sum", "max"])
    p.add_argument(
        "--group-budget", type=float, help="a group's rows in per-head heavies (default: G, PQConfig's)"
    )
    p.add_argument("--rerank", type=int, default=0, help="exact re-rank of a shortlist of RERANK x heavy")
    p.add_argument("--samples", type=int, default=5, help="timed samples of the static loop")
    p.add_argument("--steps", type=int, default=16, help="decode steps per sample")
    p.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], help="default: bfloat16 on GPUs")
    p.add_argument(
        "--corpus",
        action="store_true",
        help="prompts from held-out documents of pqattn.lab.corpus (byte-level models, e.g. "
        "models/byte-llama-13m); default: random token ids",
    )
    p.add_argument(
        "--compile",
        action="store_true",
        help="also time the static loop with the decode step's forward through torch.compile "
        "(StaticDecoder(compile=True)), same weights, same run",
    )
    p.add_argument(
        "--profile",
        action="store_true",
        help="rank 0's kernels over a few replayed steps of the static loop (compiled with --compile): "
        "GPU time by kernel and by family (weights, attention, other), launches and idle time",
    )
    p.add_argument(
        "--one-shot-all-reduce",
        action="store_true",
        help="the row-parallel linears sum by the one-shot all-reduce over symmetric memory "
        "(pqattn.integrations.tensor_parallel; a one-rank run has no all-reduce), else by NCCL's",
    )
    p.add_argument("--json", metavar="PATH")
    args = p.parse_args()
    if args.save_random:
        _save_random(args.save_random)
        return
    dtype = (
        getattr(torch, args.dtype)
        if args.dtype
        else torch.bfloat16
        if torch.cuda.is_available()
        else torch.float32
    )
    rank = int(os.environ.get("RANK", 0))
    world = int(os.environ.get("WORLD_SIZE", 1))
    one = {"device_map": "cuda" if torch.cuda.is_available() else "cpu"}  # one process: its own device
    place = tensor_parallel.from_pretrained_kwargs() if world > 1 else one
    model = transformers.AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype, **place).eval()
    all_reduce = "none" if world == 1 else "process-group"
    if world > 1 and args.one_shot_all_reduce:
        tensor_parallel.use_one_shot_all_reduce(model)
        all_reduce = "one-shot"
    vocab = model.config.vocab_size
    if args.corpus:
        from pqattn.lab import corpus

        docs = corpus.documents(corpus.find_corpus().held_out, args.prompt, args.batch)
        ids = torch.stack([torch.frombuffer(bytearray(d), dtype=torch.uint8) for d in docs]).long()
        ids = ids.to(model.device)
    else:
        gen = torch.Generator().manual_seed(0)
        ids = torch.randint(0, vocab, (args.batch, args.prompt), generator=gen).to(model.device)
    given = {
        name: getattr(args, name)
        for name in ("sink", "window", "subvectors", "bits", "share", "group_rule", "group_budget")
        if getattr(args, name) is not None
    }
    size = {"heavy": args.heavy} if args.heavy is not None else {"heavy_fraction": args.heavy_fraction}
    config = pq_hf.HFConfig(**given, **size, rerank=args.rerank, capacity=args.new + 8)
    doc: dict = {"world_size": world, "prompt": args.prompt, "batch": args.batch, "new": args.new}
    doc["all_reduce"] = all_reduce
    doc |= {"model": args.model, "corpus_prompts": args.corpus, "heavy": config.heavy_for(args.prompt)}
    doc |= {name: getattr(config, name) for name in ("sink", "window", "subvectors", "bits", "share")}
    doc |= {
        "group_rule": config.group_rule,
        "group_budget": config.group_budget,
        "rerank": config.rerank,
        "dtype": str(dtype).removeprefix("torch."),
    }
    doc["device"] = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    doc["env"] = environment(model.device)
    for kind in ("dense", "pqattn"):
        if kind == "pqattn":
            pq_hf.enable(model, config)
        with torch.no_grad():
            mask = torch.ones_like(ids)
            dynamic, t_dynamic = _timed(
                lambda m=mask: model.generate(ids, attention_mask=m, max_new_tokens=args.new, do_sample=False)
            )
        static = pq_hf.generate(model, ids, args.new)  # compiles and autotunes on its first steps
        profile = args.profile and not args.compile
        samples, loop_tokens, prof = _static_samples(
            model, ids, args.samples, args.steps, compile=False, profile=profile
        )
        states = [m._pqattn_state for m in model.modules() if getattr(m, "_pqattn_state", None) is not None]
        ms = statistics.median(samples)
        doc[kind] = {
            "dynamic_tokens": dynamic[:, args.prompt :].tolist(),
            "static_tokens": static[:, args.prompt :].tolist(),
            "dynamic_tokens_per_s": args.batch * args.new / t_dynamic,
            "static_ms_per_token": ms,
            "static_ms_per_token_samples": samples,
            "static_tokens_per_s": args.batch * 1e3 / ms,
            "index_kv_heads": states[0].index.kv_heads if states else None,
        }
        if prof is not None:
            doc[kind]["static_profile"] = prof
        if args.compile:
            torch._dynamo.reset()
            compiled, compiled_tokens, prof = _static_samples(
                model, ids, args.samples, args.steps, compile=True, profile=args.profile
            )
            if prof is not None:
                doc[kind]["compiled_static_profile"] = prof
            doc[kind]["compiled_tokens_equal"] = compiled_tokens == loop_tokens
            doc[kind]["compiled_static_ms_per_token"] = statistics.median(compiled)
            doc[kind]["compiled_static_ms_per_token_samples"] = compiled
            doc[kind]["compiled_static_tokens_per_s"] = args.batch * 1e3 / statistics.median(compiled)
        if rank == 0:
            print(kind, {k: v for k, v in doc[kind].items() if "_per_" in k}, flush=True)
            for name in ("static_profile", "compiled_static_profile"):
                families = doc[kind].get(name, {}).get("families_us_per_call")
                if families:
                    print(f"  {name}: us a step by family", families, flush=True)
    if rank == 0 and args.json:
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=1)
    if torch.distributed.is_initialized():
        # an exit that skips it may abort: Gloo's worker threads outlive the interpreter
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
