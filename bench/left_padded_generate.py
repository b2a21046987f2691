"""transformers' `generate` on a left-padded batch (how it batches prompts of other lengths), a
Llama-3-8B-shaped model with random weights: the decode time per token of pqattn's routes and of
transformers' own SDPA, on the same weights and prompts, in one run.

Routes: "pqattn" (the default policy at `--density` per head: each sequence indexed from its
first token, a step's selection moved past its padding), "split-k" (the same with every layer
in `dense_layers`: each step attends over each sequence's run of the mask through pqattn's
split-K kernel) and "sdpa" (transformers' attention with the mask); then, for the same prompts
right-padded, `pq_hf.generate`'s loop (StaticDecoder: its step captured as a CUDA graph) with the
default policy ("pqattn static loop") and with every layer dense ("split-k static loop"), per
token the median of its steps past the first two. Per token of `generate`: the median
wall-clock between consecutive tokens of one `generate` (a stopping criterion syncs and stamps
each; the prefill and the index build come before the first), the median over `--samples` runs
after a warm-up run. Also each route's greedy tokens' agreement with SDPA's, per sequence, up to
the first difference, and each route's first `generate` (compiling and tuning). Wall-clock of
the user's loop, not GPU time.

Usage: PYTHONPATH=src python3 bench/left_padded_generate.py [--prompt 8192 --batch 8 --pad 0.5
    --new 32 --samples 3 --cache dynamic --json PATH] (--tiny: a small model on the CPU, for a smoke
    run; --cache static: transformers' static cache, `cache_implementation="static"`)
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import transformers

import pqattn.integrations.hf as pq_hf
from pqattn.lab.env import environment
from pqattn.lab.suites import LLAMA3_8B_LAYERS, llama_config

ROUTES = ("pqattn", "split-k", "sdpa")
TINY = dict(layers=2, hidden=64, intermediate=128, H=4, Hkv=2, vocab=128)


def left_padded_batch(args, vocab: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """`batch` prompts of `prompt` tokens, sequence b left-padded by b/(batch-1) x `pad` of them."""
    gen = torch.Generator(device="cpu").manual_seed(0)
    ids = torch.randint(1, vocab, (args.batch, args.prompt), generator=gen)
    mask = torch.ones_like(ids)
    for b in range(args.batch):
        pad = round(args.pad * args.prompt * b / max(args.batch - 1, 1))
        mask[b, :pad], ids[b, :pad] = 0, 0
    return ids.to(device), mask.to(device)


class _Stamps(transformers.StoppingCriteria):
    """Never stops; records the wall-clock (after a sync) as each token is made."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def __call__(self, input_ids: torch.Tensor, scores, **kwargs) -> torch.Tensor:
        if input_ids.is_cuda:
            torch.cuda.synchronize()
        self.times.append(time.perf_counter())
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)

    def steps_ms(self) -> list[float]:
        """The decode steps' times: between tokens, the prefill's (the first token) left out."""
        return [(t1 - t0) * 1e3 for t0, t1 in zip(self.times, self.times[1:], strict=False)]


def _row(route: str, per_token: list[float], warmup_s: float) -> dict:
    return {
        "route": route,
        "ms_a_token": statistics.median(per_token),
        "samples_ms": per_token,
        "warmup_generate_s": warmup_s,
    }


def _right_padded(ids: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, list[int]]:
    """The same prompts right-padded (each sequence's tokens first), and their lengths: the batch
    as `pq_hf.generate` takes it."""
    order = torch.argsort(1 - mask, dim=1, stable=True)  # the visible tokens first, in order
    return ids.gather(1, order), mask.sum(1).tolist()


def _static_loop(model, ids: torch.Tensor, lengths: list[int], new: int) -> tuple[float, torch.Tensor]:
    """One run of `pq_hf.generate`'s loop (StaticDecoder: a static cache, the step captured as a
    CUDA graph on a GPU): the median wall-clock of a step past the first two (the capture), and
    the new tokens [B, new]."""
    decoder = pq_hf.StaticDecoder(model, ids, new, prompt_lengths=lengths)
    try:
        steps = []
        while decoder.steps_left > 0:
            start = time.perf_counter()
            decoder.step()
            if ids.is_cuda:
                torch.cuda.synchronize()
            steps.append((time.perf_counter() - start) * 1e3)
        decoder.sync_lengths()
        return statistics.median(steps[2:] or steps), decoder.tokens.cpu()
    finally:
        decoder.close()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--prompt", type=int, default=8192)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--pad", type=float, default=0.5, help="the most-padded sequence's padding share")
    p.add_argument("--new", type=int, default=32)
    p.add_argument("--samples", type=int, default=3)
    p.add_argument("--density", type=float, default=0.02)
    p.add_argument("--cache", choices=("dynamic", "static"), default="dynamic")
    p.add_argument("--tiny", action="store_true")
    p.add_argument("--json")
    a = p.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() and not a.tiny else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    shapes = TINY if a.tiny else LLAMA3_8B_LAYERS
    cfg = llama_config(**shapes, max_positions=a.prompt + a.new)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).to(device=device, dtype=dtype).eval()
    ids, mask = left_padded_batch(a, shapes["vocab"], device)
    policy = pq_hf.HFConfig(heavy_fraction=a.density, sink=64, window=64)
    routes = {
        "pqattn": policy,
        "split-k": pq_hf.HFConfig(heavy_fraction=a.density, dense_layers=tuple(range(shapes["layers"]))),
        "sdpa": None,
    }
    rows, tokens = [], {}
    with torch.no_grad():
        for route, config in routes.items():
            pq_hf.disable(model)
            if config is not None:
                pq_hf.enable(model, config)
            stamps = _Stamps()
            kw = dict(attention_mask=mask, max_new_tokens=a.new, do_sample=False)
            if a.cache == "static":
                kw["cache_implementation"] = "static"
            start = time.perf_counter()
            model.generate(ids, **kw)  # warm-up: compiles and tunes
            warmup_s = time.perf_counter() - start
            print(f"{route}: warm-up generate {warmup_s:.1f} s", flush=True)
            per_token = []
            for _ in range(a.samples):
                stamps.times.clear()
                out = model.generate(ids, stopping_criteria=[stamps], **kw)
                per_token.append(statistics.median(stamps.steps_ms()))
                print(f"{route}: {per_token[-1]:.2f} ms a token", flush=True)
            tokens[route] = out[:, a.prompt :].cpu()
            rows.append(_row(route, per_token, warmup_s))
        right, lengths = _right_padded(ids, mask)
        for route, config in {"pqattn static loop": policy, "split-k static loop": routes["split-k"]}.items():
            pq_hf.disable(model)
            pq_hf.enable(model, config)
            start = time.perf_counter()
            _static_loop(model, right, lengths, a.new)  # warm-up: compiles, tunes and captures
            warmup_s = time.perf_counter() - start
            per_token = []
            for _ in range(a.samples):
                ms, tokens[route] = _static_loop(model, right, lengths, a.new)
                per_token.append(ms)
                print(f"{route}: {ms:.2f} ms a token", flush=True)
            rows.append(_row(route, per_token, warmup_s))
        pq_hf.disable(model)
    for row in rows:
        same = tokens[row["route"]] == tokens["sdpa"]
        row["tokens_agreeing_with_sdpa"] = [int(s.cumprod(0).sum()) for s in same]
    result = {"args": vars(a), "environment": environment(device), "rows": rows}
    if a.json:
        with open(a.json, "w") as f:
            json.dump(result, f, indent=1)
    sdpa = next(r["ms_a_token"] for r in rows if r["route"] == "sdpa")
    for r in rows:
        print(
            f"{r['route']:20s} {r['ms_a_token']:9.2f} ms/token  {sdpa / r['ms_a_token']:5.2f}x sdpa  "
            f"agreeing tokens {r['tokens_agreeing_with_sdpa']}"
        )


if __name__ == "__main__":
    main()
