"""The README's results section is generated from bench/results/*.json and must be current."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pqattn.cli import main
from pqattn.lab.report import (
    BEGIN,
    END,
    HEAD_BEGIN,
    HEAD_END,
    render,
    render_headline,
    update_model_cards,
    update_readme,
    update_results_page,
)
from tests.lab.test_schema import make_doc

ROOT = Path(__file__).resolve().parents[2]


def test_generated_tables_match_committed_results() -> None:
    results = ROOT / "bench/results"
    assert update_readme(ROOT / "README.md", results, check=True), (
        "README headline stale: run `pqattn report`"
    )
    assert update_results_page(ROOT / "docs/results.md", results, check=True), "docs/results.md stale"
    assert update_model_cards(ROOT / "models", results, check=True), "a model card is stale"


def test_the_headline_shows_tokens_per_head_and_the_equal_bytes_yardsticks() -> None:
    text = render_headline(ROOT / "bench/results")
    header = next(line for line in text.splitlines() if line.startswith("| policy |"))
    assert "tokens / head" in header
    default = next(line for line in text.splitlines() if "the default (M=16" in line and "| 2% |" in line)
    tokens = int(default.split("|")[3])
    assert tokens == 64 + 64 + 4 * round(0.02 * 32768)  # sink + window + G per-head heavies
    passkey, gap = default.split("|")[6:8]
    assert " ± " in passkey and " ± " in gap, "every bits/byte and passkey figure with its error"
    assert "At equal bytes" in text and "per-head exact top-k at its tokens per head" in text


def test_render_and_rewrite(tmp_path, capsys) -> None:
    results = tmp_path / "results"
    results.mkdir()
    (results / "bench-x.json").write_text(json.dumps(make_doc([("c", "pqattn", [1.0, 2.0])])))
    text = render(results)
    assert text.startswith(BEGIN) and text.endswith(END)
    assert "| select/c | **pqattn** | 1.00 |" in text
    readme, page = tmp_path / "README.md", tmp_path / "results.md"
    readme.write_text(f"intro\n{HEAD_BEGIN}\nold\n{HEAD_END}\noutro\n")
    page.write_text(f"intro\n{BEGIN}\nold\n{END}\noutro\n")
    argv = ["report", "--readme", str(readme), "--page", str(page), "--results", str(results)]
    argv += ["--models", str(tmp_path / "no-models"), "--root", str(tmp_path)]
    assert main([*argv, "--check"]) == 1
    capsys.readouterr()
    assert main(argv) == 0
    assert capsys.readouterr().out.startswith(f"rewrote the generated sections of {readme}, {page}")
    assert main([*argv, "--check"]) == 0
    assert capsys.readouterr().out.startswith(f"up to date with {results}: {readme}, {page}")
    new = page.read_text()
    assert new.startswith("intro\n") and new.endswith("outro\n") and "old" not in new
    assert "old" not in readme.read_text(), "the headline is rewritten (empty without a pareto result)"


def test_missing_markers_and_foreign_json(tmp_path) -> None:
    readme = tmp_path / "README.md"
    readme.write_text("no markers\n")
    with pytest.raises(ValueError, match="markers"):
        update_readme(readme, tmp_path, check=True)
    (tmp_path / "other.json").write_text("{}")
    with pytest.raises(ValueError, match="neither"):
        render(tmp_path)


def test_host_tier_rows_name_their_lists() -> None:
    """A large-part row of `bench/host_tier.py --overlaps` says which heavy lists it ran (the
    selection's, or lists keeping a share of the previous step's)."""
    text = render(ROOT / "bench/results").split("(host-tier-overlaps-NVIDIA_H100.json)")[1]
    text = text.split("\n### ")[0]
    rows = [line for line in text.splitlines() if line.startswith("| llama32L-B1-512K |")]
    assert [r.split(" | ")[1] for r in rows] == ["selected", "keep 0.5", "keep 0.8", "keep 0.9", "keep 0.95"]


def test_model_loop_rows_show_their_step_by_family(tmp_path) -> None:
    doc = make_doc([("llama-B1", "pqattn", [2000.0]), ("llama-B1", "dense", [3000.0])])
    row = doc["results"][0]
    row["suite"], row["ms_per_token"] = "generate", 2.0
    split = {"weights": (1.5, 1.4), "attention": (0.3, 0.05), "other": (0.15, 0.0), "idle": (0.05, 0.0)}
    row["breakdown"] = {f: {"ms": ms, "floor_ms": floor} for f, (ms, floor) in split.items()}
    (tmp_path / "bench-x.json").write_text(json.dumps(doc))
    text = render(tmp_path)
    assert "| generate/llama-B1 | pqattn | 2.00 | 1.50 (1.40) | 0.30 (0.05) | 0.15 | 0.05 |" in text
    by_family = text.split("A step's kernels by family")[1]
    assert "select/llama-B1 | dense" not in by_family, "rows without a split stay out of it"


def test_model_loop_speedups_show_back_to_back_steps(tmp_path) -> None:
    """A loop's speed-up against a baseline shows its back-to-back figure beside the latency one."""
    doc = make_doc([("llama-B1", "pqattn", [2000.0]), ("llama-B1", "dense", [3000.0])])
    doc["results"][0]["vs"] = {"dense": {"mode": "eager", "speedup": 1.5, "pipelined_speedup": 1.25}}
    (tmp_path / "bench-x.json").write_text(json.dumps(doc))
    assert "| 1.50x vs dense (back to back 1.25x) |" in render(tmp_path)
