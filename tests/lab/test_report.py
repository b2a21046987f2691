"""The README's results section is generated from bench/results/*.json and must be current."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pqattn.cli import main
from pqattn.lab.report import BEGIN, END, render, update_readme
from tests.lab.test_schema import make_doc

ROOT = Path(__file__).resolve().parents[2]


def test_readme_matches_committed_results() -> None:
    assert update_readme(ROOT / "README.md", ROOT / "bench/results", check=True), (
        "README results section is stale: run `pqattn report`"
    )


def test_render_and_rewrite(tmp_path, capsys) -> None:
    results = tmp_path / "results"
    results.mkdir()
    (results / "bench-x.json").write_text(json.dumps(make_doc([("c", "pqattn", [1.0, 2.0])])))
    text = render(results)
    assert text.startswith(BEGIN) and text.endswith(END)
    assert "| select/c | **pqattn** | 1.00 |" in text
    readme = tmp_path / "README.md"
    readme.write_text(f"intro\n{BEGIN}\nold\n{END}\noutro\n")
    assert main(["report", "--check", "--readme", str(readme), "--results", str(results)]) == 1
    assert main(["report", "--readme", str(readme), "--results", str(results)]) == 0
    assert main(["report", "--check", "--readme", str(readme), "--results", str(results)]) == 0
    new = readme.read_text()
    assert new.startswith("intro\n") and new.endswith("outro\n") and "old" not in new


def test_missing_markers_and_foreign_json(tmp_path) -> None:
    readme = tmp_path / "README.md"
    readme.write_text("no markers\n")
    with pytest.raises(ValueError, match="markers"):
        update_readme(readme, tmp_path, check=True)
    (tmp_path / "other.json").write_text("{}")
    with pytest.raises(ValueError, match="neither"):
        render(tmp_path)
