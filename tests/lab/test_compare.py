"""`pqattn compare`: verdicts from samples, and the regression gate's exit code."""

from __future__ import annotations

import json

import numpy as np
import pytest

from pqattn.cli import main
from pqattn.lab.compare import compare_docs, format_comparison
from tests.lab.test_schema import make_doc


def samples(center: float, n: int = 40, spread: float = 0.01, seed: int = 0) -> list[float]:
    rng = np.random.default_rng(seed)
    return list(center * (1 + spread * rng.standard_normal(n)))


def write(tmp_path, name: str, doc: dict) -> str:
    path = tmp_path / name
    path.write_text(json.dumps(doc))
    return str(path)


def test_identical_runs_are_the_same(tmp_path, capsys) -> None:
    doc = make_doc([("c", "pqattn", samples(10.0)), ("d", "pqattn", samples(5.0, seed=1))])
    result = compare_docs(doc, doc)
    assert [r["verdict"] for r in result["rows"]] == ["same", "same"]
    assert [r["ratio"] for r in result["rows"]] == [1.0, 1.0]
    assert main(["compare", write(tmp_path, "a.json", doc), write(tmp_path, "b.json", doc)]) == 0
    assert "no regression" in capsys.readouterr().out


def test_regression_fails_the_gate(tmp_path, capsys) -> None:
    a = make_doc([("c", "pqattn", samples(10.0)), ("d", "pqattn", samples(5.0, seed=1))])
    b = make_doc([("c", "pqattn", samples(11.0, seed=2)), ("d", "pqattn", samples(4.0, seed=3))])
    result = compare_docs(a, b)
    by_key = {r["key"]: r for r in result["rows"]}
    slow, fast = by_key["select/c/pqattn"], by_key["select/d/pqattn"]
    assert (
        slow["verdict"] == "slower" and slow["regression"] and slow["ratio"] == pytest.approx(1.1, rel=0.02)
    )
    assert slow["ci_low"] > 1.05 and slow["cliffs_delta"] > 0.9 and slow["p_value"] < 1e-6
    assert fast["verdict"] == "faster" and not fast["regression"]
    assert result["regressions"] == ["select/c/pqattn"]
    assert main(["compare", write(tmp_path, "a.json", a), write(tmp_path, "b.json", b)]) == 1
    out = capsys.readouterr().out
    assert "REGRESSION" in out and "1 regression(s)" in out


def test_small_slowdown_passes_the_gate() -> None:
    a = make_doc([("c", "pqattn", samples(10.0, spread=0.001))])
    b = make_doc([("c", "pqattn", samples(10.2, spread=0.001, seed=5))])
    row = compare_docs(a, b)["rows"][0]
    assert row["verdict"] == "slower" and not row["regression"]


def test_unmatched_rows_and_environment_warnings() -> None:
    a = make_doc([("c", "pqattn", samples(1.0)), ("old", "pqattn", samples(1.0))], device="GPU X")
    b = make_doc([("c", "pqattn", samples(1.0)), ("new", "pqattn", samples(1.0))], device="GPU Y")
    result = compare_docs(a, b)
    assert result["only_a"] == ["select/old/pqattn"] and result["only_b"] == ["select/new/pqattn"]
    assert any("device_name" in w for w in result["warnings"])
    text = format_comparison(result)
    assert "only in A: select/old/pqattn" in text and "warning: device_name" in text


def test_a_driver_on_several_lines_compares_by_its_first() -> None:
    """nvidia-smi prints the driver once per GPU: equal drivers warn of nothing, others show one line."""
    a = make_doc([("c", "pqattn", samples(1.0))])
    b = make_doc([("c", "pqattn", samples(1.0))])
    a["environment"]["driver"] = "580.159.04"
    b["environment"]["driver"] = "580.159.04\n580.159.04"
    assert compare_docs(a, b)["warnings"] == []
    b["environment"]["driver"] = "590.1\n590.1"
    assert compare_docs(a, b)["warnings"] == ["driver differs: 580.159.04 vs 590.1"]


def test_timing_mode_choice() -> None:
    a = make_doc([("c", "pqattn", samples(1.0))])
    b = make_doc([("c", "pqattn", samples(1.0))])
    b["results"][0]["timings"]["graph"] = None
    assert compare_docs(a, b)["rows"][0]["mode"] == "eager"  # auto falls back when one side lacks graph
    assert "missing" in compare_docs(a, b, mode="graph")["rows"][0]
    assert compare_docs(a, b, mode="pipelined")["rows"][0]["mode"] == "pipelined"
    with pytest.raises(ValueError, match="timing"):
        compare_docs(a, b, mode="fastest")


def test_cli_rejects_a_non_results_file(tmp_path, capsys) -> None:
    bad = write(tmp_path, "bad.json", {"schema": "nope"})
    good = write(tmp_path, "good.json", make_doc([("c", "pqattn", samples(1.0))]))
    assert main(["compare", good, bad]) == 2
    assert "schema" in capsys.readouterr().err
