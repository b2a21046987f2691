"""The notes' tied figures and citations (`pqattn.lab.notes`), and the committed notes current."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pqattn.lab.notes import missing_citations, render_figures, update_notes

ROOT = Path(__file__).resolve().parents[2]


def _checkout(tmp_path: Path, note: str) -> Path:
    (tmp_path / "bench" / "results").mkdir(parents=True)
    (tmp_path / "bench" / "quality").mkdir(parents=True)
    (tmp_path / "docs").mkdir()
    doc = {"parts": {"large": [{"case": "a", "ms": 38.25}, {"case": "b", "ms": 33.09, "us": 18000.4}]}}
    (tmp_path / "bench" / "quality" / "run-NVIDIA_H100.json").write_text(json.dumps(doc))
    (tmp_path / "docs" / "note.md").write_text(note)
    (tmp_path / "README.md").write_text("no figures\n")
    return tmp_path


def test_tied_figures_are_rewritten_from_their_json_and_checked(tmp_path) -> None:
    note = (
        "token 30.0<!-- run-NVIDIA_H100.json parts/large/case=b,ms=33.09/ms .1f --> ms, "
        "fetch 1.0<!-- run-NVIDIA_H100.json parts/large/1/us *1e-3:.2f --> ms, "
        "first 38.2<!-- run-NVIDIA_H100.json parts/large/0/ms .2f -->.\n"
    )
    root = _checkout(tmp_path, note)
    assert update_notes(root, check=True) == (False, [])
    assert (root / "docs" / "note.md").read_text() == note, "check writes nothing"
    assert update_notes(root, check=False) == (False, [])
    text = (root / "docs" / "note.md").read_text()
    assert "token 33.1<!--" in text and "fetch 18.00<!--" in text and "first 38.25<!--" in text
    assert update_notes(root, check=True) == (True, [])


@pytest.mark.parametrize(
    "marker,match",
    [
        ("1<!-- gone-NVIDIA_H100.json parts .1f -->", "no such file"),
        ("1<!-- run-NVIDIA_H100.json parts/small/ms .1f -->", "'small'"),
        ("1<!-- run-NVIDIA_H100.json parts/large/case=z/ms .1f -->", "case=z"),
        ("1<!-- run-NVIDIA_H100.json parts/large/case=a,ms=33.09/ms .1f -->", "case=a,ms=33.09"),
        ("1<!-- run-NVIDIA_H100.json parts/large .1f -->", "expected a number"),
        ("1<!-- run-NVIDIA_H100.json parts/large/0/ms %d -->", "format"),
    ],
)
def test_a_figure_tied_to_nothing_is_an_error(tmp_path, marker: str, match: str) -> None:
    root = _checkout(tmp_path, "")
    with pytest.raises(ValueError, match=match):
        render_figures(root, f"see {marker}", "note.md")


def test_a_tie_that_does_not_parse_is_a_problem(tmp_path) -> None:
    """A comment naming a results file that ties no figure (a space in its path, no number before
    it) would go unchecked: it is reported; one in a code span (the syntax shown) is not."""
    note = (
        "spaced 38.25<!-- run-NVIDIA_H100.json parts/large/case=a b/ms .2f -->, "
        "bare <!-- run-NVIDIA_H100.json parts/large/0/ms .2f -->, "
        "tied 38.25<!-- run-NVIDIA_H100.json parts/large/0/ms .2f -->, "
        "shown `<!-- FILE.json path/to/value .1f -->`.\n"
    )
    current, problems = update_notes(_checkout(tmp_path, note), check=True)
    assert current
    assert len(problems) == 2 and all("ties no figure" in p for p in problems), problems
    assert "case=a b" in problems[0] and "parts/large/0/ms" in problems[1]


def test_cited_files_must_exist(tmp_path) -> None:
    root = _checkout(tmp_path, "")
    (root / "bench" / "tool.py").write_text("")
    text = (
        "run `bench/tool.py` and `bench/gone.py` (run-NVIDIA_H100.json, lost-NVIDIA_H200.json); "
        "patterns are not citations: `host-tier-*.json`, tp-{1,2}gpu-NVIDIA_H200.json."
    )
    assert missing_citations(root, text) == ["bench/gone.py", "lost-NVIDIA_H200.json"]
    (root / "docs" / "note.md").write_text(text)
    current, problems = update_notes(root, check=True)
    assert current and problems == [
        "docs/note.md cites bench/gone.py, which does not exist",
        "docs/note.md cites lost-NVIDIA_H200.json, which does not exist",
    ]


def test_the_committed_notes_are_current_and_cite_what_exists() -> None:
    current, problems = update_notes(ROOT, check=True)
    assert problems == [] and current, "run `pqattn report`"
    tied = {
        p.name
        for p in (ROOT / "docs").rglob("*.md")
        if "<!-- " in p.read_text() and ".json " in p.read_text()
    }
    assert {"host.md", "decode.md", "quality.md"} <= tied, "the design notes tie their key figures"
