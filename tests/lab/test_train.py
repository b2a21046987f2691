"""The training recipe: planted passkey pairs, the schedule, and a tiny end-to-end run."""

from __future__ import annotations

import itertools
import json

import pytest
import torch
import transformers

from pqattn.cli import main
from pqattn.lab import corpus, train


def test_plants_are_pairs_of_one_line() -> None:
    gen = torch.Generator().manual_seed(3)
    windows = torch.full((64, 600), ord("."), dtype=torch.uint8)
    train.plant_pairs(windows, gen, rate=1.0)
    for w in windows:
        text = bytes(w.tolist()).decode()
        lines = [x for x in text.split("\n") if " = " in x]
        assert lines, "rate 1: every window holds a pair"
        whole = [x for x in lines if x.count(" = ") == 1 and x.split(" = ")[1].isdigit()]
        counts = {x: text.count("\n" + x + "\n") for x in whole}
        assert any(c == 2 for c in counts.values()), f"no line planted twice in {text!r}"
    untouched = torch.full((4, 600), ord("."), dtype=torch.uint8)
    train.plant_pairs(untouched, gen, rate=0.0)
    assert (untouched == ord(".")).all()


def test_planted_distances_reach_across_the_window() -> None:
    gen = torch.Generator().manual_seed(0)
    far = 0
    for _ in range(40):
        w = torch.full((1, 4000), 0, dtype=torch.uint8)
        train.plant_pairs(w, gen, rate=1.0)
        nz = (w[0] != 0).nonzero()[:, 0]
        far = max(far, int(nz.max() - nz.min()))
    assert far > 3000, "long distances are drawn as often as short ones"


def test_schedule() -> None:
    spec = train.TrainSpec(lr=1.0, warmup_steps=10, min_lr_ratio=0.1)
    assert train.lr_at(0, 100, spec) == pytest.approx(0.1)
    assert train.lr_at(9, 100, spec) == pytest.approx(1.0)
    assert train.lr_at(10, 100, spec) == pytest.approx(1.0)
    assert train.lr_at(100, 100, spec) == pytest.approx(0.1)
    mids = [train.lr_at(s, 100, spec) for s in range(10, 101)]
    assert all(a >= b for a, b in itertools.pairwise(mids)), "cosine decay never rises"
    phased = train.TrainSpec(phases=((256, 0.35), (1024, 0.45), (2048, 0.2)))
    assert train.phase_steps(phased, 101) == [35, 45, 21]


def test_a_tiny_run_is_seeded_and_loads_back(tmp_path) -> None:
    root = tmp_path / "site"
    for i in range(24):
        (root / f"m{i:02d}.py").parent.mkdir(parents=True, exist_ok=True)
        (root / f"m{i:02d}.py").write_text("".join(f"value_{i}_{j} = {i * j}\n" for j in range(60)))
    c = corpus.find_corpus(corpus.CorpusSpec(min_bytes=1, holdout_every=4), roots=[str(root)])
    ms = train.ModelSpec(
        layers=1, hidden=32, heads=4, kv_heads=1, head_dim=8, intermediate=32, max_positions=512
    )
    spec = train.TrainSpec(
        phases=((64, 0.5), (128, 0.5)), tokens_per_step=512, steps=6, warmup_steps=2, log_every=3
    )
    cpu = torch.device("cpu")
    lines: list[str] = []
    a, rec = train.train(ms, spec, device=cpu, corpus=c, log=lines.append)
    b, _ = train.train(ms, spec, device=cpu, corpus=c, log=lambda _: None)
    for pa, pb in zip(a.parameters(), b.parameters(), strict=True):
        assert torch.equal(pa, pb), "same seed, same weights"
    assert any(x.startswith("step     6/6") for x in lines) and rec["phase_steps"] == [3, 3]
    assert rec["corpus"]["digest"] == c.digest and rec["tokens"] == 6 * 512
    train.save(a, rec, str(tmp_path / "model"))
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "model")
    assert loaded.config.num_key_value_heads == 1 and loaded.config.vocab_size == 256
    assert next(loaded.parameters()).dtype == torch.bfloat16
    assert json.loads((tmp_path / "model" / "training.json").read_text())["train_spec"]["steps"] == 6


def test_cli_rejects_bad_phases(tmp_path) -> None:
    assert main(["train", "--out", str(tmp_path), "--phases", "2048-0.5", "--device", "cpu"]) == 2
