"""pqattn quality: the density sweep on the workload and on a local transformers model's cache."""

from __future__ import annotations

import json

import transformers

from pqattn.cli import main
from pqattn.lab import quality


def test_sweep_rows_and_their_invariants() -> None:
    problem = quality.workload_problem(tokens=1024)
    rows = quality.sweep(problem, quality.QualitySettings(densities=(0.01, 0.1), iters=3))
    assert len(rows) == 2 * len(quality.METHODS)
    by = {(r["density"], r["method"]): r for r in rows}
    for d in (0.01, 0.1):
        assert by[(d, "oracle")]["recall"] == 1.0
        assert by[(d, "oracle")]["mass"] >= by[(d, "pq")]["mass"] - 1e-6
        assert by[(d, "oracle")]["mass"] >= by[(d, "streaming")]["mass"] - 1e-6
        # equal token budgets for the three methods
        assert len({round(by[(d, m)]["tokens"]) for m in quality.METHODS}) == 1
    assert by[(0.1, "oracle")]["rel_err"] <= by[(0.01, "oracle")]["rel_err"] + 1e-9


def _save_model(path, layers: int) -> str:
    config = transformers.LlamaConfig(
        vocab_size=96,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
    )
    transformers.LlamaForCausalLM(config).save_pretrained(path)
    return str(path)


def test_cli_on_a_local_model(tmp_path) -> None:
    model = _save_model(tmp_path / "model", layers=3)
    out, png = tmp_path / "q.json", tmp_path / "q.png"
    argv = ["quality", "--model", model, "--prompt-tokens", "300", "--layers", "0,2"]
    argv += [
        "--densities",
        "0.02,0.2",
        "--device",
        "cpu",
        "--json",
        str(out),
        "--plot",
        str(png),
        "--iters",
        "2",
    ]
    assert main(argv) == 0
    doc = json.loads(out.read_text())
    assert doc["source"] == model and {r["problem"] for r in doc["rows"]} == {"layer0", "layer2"}
    assert all(r["problems"] == 2 for r in doc["summary"]) and png.stat().st_size > 0


def test_cli_rejects_unknown_layers(tmp_path) -> None:
    model = _save_model(tmp_path / "m", layers=1)
    argv = ["quality", "--model", model, "--prompt-tokens", "50", "--layers", "3", "--device", "cpu"]
    assert main(argv) == 2  # pqattn quality: layers: expected indices in [0], got [3]
