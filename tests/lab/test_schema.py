"""The bench results schema: what compare and report rely on is checked, and errors name the field."""

from __future__ import annotations

import copy
import json

import pytest

from pqattn.lab.schema import BENCH_SCHEMA, load, validate


def timing(samples: list[float]) -> dict:
    return {
        "median_us": 1.0,
        "iqr_us": 0.1,
        "min_us": 0.9,
        "repeats": len(samples),
        "samples_us": list(samples),
    }


def make_doc(rows: list[tuple[str, str, list[float]]], *, device: str = "GPU X", sha: str = "a" * 40) -> dict:
    """A minimal valid document: rows of (case, impl, eager samples), graph timings equal to eager."""
    results = []
    for case, impl, samples in rows:
        results.append(
            {
                "suite": "select",
                "case": case,
                "params": {},
                "impl": impl,
                "role": "pqattn" if impl == "pqattn" else "baseline",
                "note": "",
                "bytes": 1000,
                "flops": 0,
                "rotation": 1,
                "skipped": None,
                "timings": {"graph": timing(samples), "eager": timing(samples), "pipelined": timing(samples)},
                "primary": "graph",
                "host_sync": None,
                "graph_error": None,
                "gbps": 1.0,
                "pct_copy": 1.0,
                "tflops": 0.0,
                "pct_matmul": 0.0,
                "floor_us": 0.5,
            }
        )
    return {
        "schema": BENCH_SCHEMA,
        "created": "2026-11-22T00:00:00+00:00",
        "argv": None,
        "size": "quick",
        "suites": ["select"],
        "environment": {"git_sha": sha, "device_name": device, "torch": "2", "triton": "3", "driver": "1"},
        "ceilings": {"copy_gbps": 4000.0, "matmul_tflops": 700.0},
        "settings": {},
        "results": results,
    }


def test_valid_document_passes(tmp_path) -> None:
    doc = make_doc([("c", "pqattn", [1.0, 2.0]), ("c", "torch.topk", [3.0, 4.0])])
    assert validate(doc) is doc
    path = tmp_path / "d.json"
    path.write_text(json.dumps(doc))
    assert load(path) == doc


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda d: d.update(schema="other/1"), "schema"),
        (lambda d: d["environment"].pop("git_sha"), "environment"),
        (lambda d: d["ceilings"].update(copy_gbps=0), "ceilings.copy_gbps"),
        (lambda d: d["results"][0].pop("impl"), r"results\[0\]"),
        (lambda d: d["results"][1].update(role="other"), r"results\[1\].role"),
        (lambda d: d["results"][0]["timings"]["eager"].update(repeats=3), r"results\[0\].timings.eager"),
        (lambda d: d["results"][0]["timings"]["graph"]["samples_us"].__setitem__(0, float("nan")), "graph"),
        (lambda d: d["results"][0]["timings"].update(pipelined=None), "pipelined"),
        (lambda d: d["results"][0].update(primary="eager"), "primary"),
        (lambda d: d["results"].append(copy.deepcopy(d["results"][0])), "duplicate"),
    ],
)
def test_broken_documents_name_the_field(mutate, message) -> None:
    doc = make_doc([("c", "pqattn", [1.0, 2.0]), ("c", "torch.topk", [3.0, 4.0])])
    mutate(doc)
    with pytest.raises(ValueError, match=message):
        validate(doc)


def test_skipped_rows_need_no_timings() -> None:
    doc = make_doc([("c", "pqattn", [1.0, 2.0])])
    row = doc["results"][0]
    for k in ("timings", "primary", "gbps"):
        del row[k]
    row["skipped"] = "too big"
    validate(doc)


def test_load_reports_unreadable_files(tmp_path) -> None:
    path = tmp_path / "x.json"
    path.write_text("{not json")
    with pytest.raises(ValueError, match="cannot read"):
        load(path)
