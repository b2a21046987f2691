"""`pqattn train`: the recipe of the project's quality ground truth, a small long-context byte-level Llama.

No pretrained weights can be downloaded where pqattn is developed, so the model whose quality
sparse attention must keep is trained here, in minutes, on the corpus of `pqattn.lab.corpus`.

* Model: transformers' `LlamaForCausalLM` (RoPE, SwiGLU, RMSNorm), vocabulary of the 256 byte
  values, GQA with 4 query heads per KV head (`ModelSpec`).
* Data: random windows of the concatenated training files (name order); a share of the windows
  (`plant_rate`) gets one to three passkey pairs planted: a line `NAME = VALUE` and, a distance
  uniform over the window's room later, the same line again, so that retrieving a value across
  the whole context is a skill the text teaches (the passkey task of `pqattn.lab.tasks` asks for
  it in this form).
* Schedule: phases of growing context (`phases`: context and share of the steps), a constant
  number of tokens per step, AdamW with linear warm-up and cosine decay, bf16 autocast.
* Budget: with `steps` unset, the number of steps is fixed before training from a timed trial of
  each phase on a throw-away copy of the model, so that training fits `budget_s` seconds; the
  steps are printed and recorded, and `--steps` replays the run (seeded, same data order).
"""

from __future__ import annotations

import copy
import dataclasses
import json
import math
import os
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from pqattn.lab import corpus as corpus_mod
from pqattn.lab.env import environment
from pqattn.runtime.progress import Progress

LOG2 = math.log(2.0)
NAME_LETTERS = b"ABCDEFGHIJKLMNOPQRSTUVWXYZ"
NAME_LENGTH = 8  # letters of a planted name


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    layers: int = 6
    hidden: int = 512
    heads: int = 8
    kv_heads: int = 2
    head_dim: int = 64
    intermediate: int = 1024
    rope_theta: float = 500000.0
    max_positions: int = 32768

    def config(self):
        import transformers

        return transformers.LlamaConfig(
            vocab_size=256,
            hidden_size=self.hidden,
            intermediate_size=self.intermediate,
            num_hidden_layers=self.layers,
            num_attention_heads=self.heads,
            num_key_value_heads=self.kv_heads,
            head_dim=self.head_dim,
            max_position_embeddings=self.max_positions,
            rope_parameters={"rope_type": "default", "rope_theta": self.rope_theta},
            tie_word_embeddings=True,
            bos_token_id=None,
            eos_token_id=None,
            pad_token_id=None,
        )


@dataclasses.dataclass(frozen=True)
class TrainSpec:
    seed: int = 0
    phases: tuple[tuple[int, float], ...] = ((2048, 0.35), (16384, 0.45), (32768, 0.2))
    tokens_per_step: int = 131072
    lr: float = 2e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 100
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    plant_rate: float = 0.5
    budget_s: float = 450.0
    steps: int | None = None  # total over the phases; None: from the timed trial and budget_s
    deadline_s: float | None = None  # stop early (recorded) once training has run this long
    log_every: int = 25


def passkey_line(name: bytes, value: bytes) -> bytes:
    """The planted line (training and the passkey task share it)."""
    return b"\n" + name + b" = " + value + b"\n"


def random_name(gen: torch.Generator) -> bytes:
    idx = torch.randint(0, len(NAME_LETTERS), (NAME_LENGTH,), generator=gen)
    return bytes(NAME_LETTERS[i] for i in idx.tolist())


def random_value(gen: torch.Generator) -> bytes:
    return str(int(torch.randint(10000, 100000, (1,), generator=gen))).encode()


def plant_pairs(windows: torch.Tensor, gen: torch.Generator, rate: float) -> None:
    """Overwrite passkey pairs into a share `rate` of the windows [B, L] (uint8, in place)."""
    B, L = windows.shape
    flat_idx, flat_val = [], []
    for b in range(B):
        if float(torch.rand((), generator=gen)) >= rate:
            continue
        for _ in range(int(torch.randint(1, 4, (), generator=gen))):
            line = passkey_line(random_name(gen), random_value(gen))
            n = len(line)
            if 4 * n > L:  # too short a window to hold the pair
                continue
            # the distance uniform over what the window allows, so that long ones are as common
            distance = int(torch.randint(n, L - n + 1, (), generator=gen))
            first = int(torch.randint(0, L - n - distance + 1, (), generator=gen))
            second = first + distance
            for start in (first, second):
                flat_idx.append(b * L + torch.arange(start, start + n))
                flat_val.append(torch.frombuffer(bytearray(line), dtype=torch.uint8))
    if flat_idx:
        idx = torch.cat(flat_idx).to(windows.device)
        windows.view(-1)[idx] = torch.cat(flat_val).to(windows.device)


def lr_at(step: int, total: int, spec: TrainSpec) -> float:
    if step < spec.warmup_steps:
        return spec.lr * (step + 1) / spec.warmup_steps
    progress = (step - spec.warmup_steps) / max(1, total - spec.warmup_steps)
    cos = 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
    return spec.lr * (spec.min_lr_ratio + (1 - spec.min_lr_ratio) * cos)


def phase_steps(spec: TrainSpec, total: int) -> list[int]:
    """Steps per phase for `total` steps (shares rounded, the remainder to the last phase)."""
    counts = [int(total * share) for _, share in spec.phases]
    counts[-1] = total - sum(counts[:-1])
    return counts


class _Trainer:
    def __init__(self, model, data: torch.Tensor, spec: TrainSpec, device: torch.device) -> None:
        self.model, self.data, self.spec, self.device = model, data, spec, device
        decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
        other = [p for n, p in model.named_parameters() if p.dim() < 2]
        self.opt = torch.optim.AdamW(
            [{"params": decay, "weight_decay": spec.weight_decay}, {"params": other, "weight_decay": 0.0}],
            lr=spec.lr,
            betas=(0.9, 0.95),
            eps=1e-8,
            fused=device.type == "cuda",
        )
        self.gen = torch.Generator().manual_seed(spec.seed)

    def batch(self, context: int) -> torch.Tensor:
        B = max(1, self.spec.tokens_per_step // context)
        starts = torch.randint(0, self.data.numel() - context - 1, (B,), generator=self.gen)
        idx = starts.to(self.device)[:, None] + torch.arange(context + 1, device=self.device)
        windows = self.data[idx]
        plant_pairs(windows, self.gen, self.spec.plant_rate)
        return windows.long()

    def step(self, context: int, lr: float) -> float:
        windows = self.batch(context)
        for group in self.opt.param_groups:
            group["lr"] = lr
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.device.type == "cuda"):
            logits = self.model(windows[:, :-1]).logits
        loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), windows[:, 1:].reshape(-1))
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.spec.grad_clip)
        self.opt.step()
        return loss.detach()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_phases(
    model, data: torch.Tensor, spec: TrainSpec, device: torch.device, steps: int = 4
) -> list[float]:
    """Seconds per step of each phase, from a trial on a copy of the model (the model is untouched)."""
    trial = _Trainer(copy.deepcopy(model), data, dataclasses.replace(spec, seed=spec.seed + 1), device)
    per_step = []
    for context, _ in spec.phases:
        trial.step(context, spec.lr * 0.1)  # warm-up: kernels and allocator
        _sync(device)
        t0 = time.perf_counter()
        for _ in range(steps):
            trial.step(context, spec.lr * 0.1)
        _sync(device)
        per_step.append((time.perf_counter() - t0) / steps)
    del trial
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return per_step


def train(
    model_spec: ModelSpec,
    spec: TrainSpec,
    *,
    device: torch.device,
    corpus: corpus_mod.Corpus,
    log: Callable[[str], None] = print,
):
    """Train a model from scratch; returns (model in float32, record dict)."""
    import transformers

    torch.manual_seed(spec.seed)
    t_start = time.perf_counter()
    data = corpus_mod.read_bytes(corpus.train).to(device)
    log(f"corpus: {len(corpus.train)} train files, {data.numel() / 1e6:.1f} MB, digest {corpus.digest[:16]}")
    model = transformers.LlamaForCausalLM(model_spec.config()).to(device)
    model.config.use_cache = False
    params = sum(p.numel() for p in model.parameters())
    log(f"model: {params / 1e6:.2f}M parameters, {model_spec}")

    trial_s: list[float] | None = None
    if spec.steps is None:
        trial_s = time_phases(model, data, spec, device)
        per_total_step = sum(share * s for (_, share), s in zip(spec.phases, trial_s, strict=True))
        total = max(1, int(spec.budget_s / per_total_step))
        per_phase = zip(spec.phases, trial_s, strict=True)
        log("timed trial: " + ", ".join(f"{c}: {s * 1e3:.0f} ms/step" for (c, _), s in per_phase))
    else:
        total = spec.steps
    counts = phase_steps(spec, total)
    log(f"steps: {total} ({', '.join(f'{n} at {c}' for (c, _), n in zip(spec.phases, counts, strict=True))})")

    trainer = _Trainer(model, data, spec, device)
    curve = []
    step = 0
    _sync(device)
    t0 = time.perf_counter()
    stopped_at = None
    tick = Progress("train", total)
    for (context, _), n in zip(spec.phases, counts, strict=True):
        window_loss = []
        for _ in range(n):
            if spec.deadline_s is not None and time.perf_counter() - t0 > spec.deadline_s:
                stopped_at = stopped_at or step
                break
            loss = trainer.step(context, lr_at(step, total, spec))
            window_loss.append(loss)
            step += 1
            tick(step, f"at context {context}")
            if step % spec.log_every == 0 or step == total:
                mean = float(torch.stack(window_loss).mean()) / LOG2
                elapsed = time.perf_counter() - t0
                tok_s = step * spec.tokens_per_step / elapsed
                curve.append({"step": step, "context": context, "bpb": mean, "elapsed_s": elapsed})
                tick.close()  # the log line takes the progress line's place
                log(
                    f"step {step:>5}/{total} ctx {context:>5}  train {mean:.3f} bits/byte  "
                    f"{tok_s / 1e3:.0f}K tok/s  {elapsed:.0f} s"
                )
                window_loss = []
    tick.close()
    _sync(device)
    train_s = time.perf_counter() - t0
    if stopped_at is not None:
        log(f"stopped at step {stopped_at} of {total}: past the deadline of {spec.deadline_s} s")
    record = {
        "model_spec": dataclasses.asdict(model_spec),
        "train_spec": dataclasses.asdict(spec) | {"steps": total},
        "phase_steps": counts,
        "stopped_early_at_step": stopped_at,
        "trial_s_per_step": trial_s,
        "parameters": params,
        "train_s": train_s,
        "total_s": time.perf_counter() - t_start,
        "tokens": step * spec.tokens_per_step,
        "curve": curve,
        "corpus": corpus.summary(),
        "environment": environment(device) | {"transformers": transformers.__version__},
    }
    return model, record


def save(model, record: dict, out: str, max_shard_mb: int = 15) -> None:
    """bf16 safetensors (shards under `max_shard_mb`), config.json and training.json in `out`."""
    os.makedirs(out, exist_ok=True)
    model.config.use_cache = True
    model.to(torch.bfloat16).save_pretrained(out, max_shard_size=f"{max_shard_mb}MB")
    with open(os.path.join(out, "training.json"), "w") as f:
        json.dump(record, f, indent=1)
