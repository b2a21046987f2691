"""The quality/speed Pareto: step times, generator quality, the joined rows, the plot and the report."""

from __future__ import annotations

import json

import torch

from pqattn.cli import main
from pqattn.lab import pareto, report
from pqattn.lab.policies import policy_grid


def _tasks_doc() -> dict:
    """A `pqattn tasks` document of two policies at one density (the fields pareto and report read)."""
    settings = {"sink": 8, "window": 8, "position_docs": 1, "tail_docs": 1, "tail_rows": 4}
    settings |= {"passkey_buckets": 1, "passkey_trials": 2, "passkey_context": 512}
    env = {"device_name": "cpu", "torch": torch.__version__, "triton": "x", "git_sha": "abc"}
    tail = [
        {"context": 512, "policy": "dense", "gap": 0.0, "mass": 1.0},
        {"context": 512, "policy": "pq-M2-b4@0.1", "gap": 0.25, "gap_se": 0.01, "mass": 0.7},
    ]
    passkey = [
        {"policy": "dense", "depth_lo": 0.0, "depth_hi": 1.0, "context": 512, "accuracy": 1.0},
        {
            "policy": "pq-M2-b4@0.1",
            "depth_lo": 0.0,
            "depth_hi": 1.0,
            "context": 512,
            "accuracy": 0.5,
            "se": 0.35,
        },
    ]
    positions = [{"context": 512, "lo": 0, "hi": 512, "bpb": 1.5, "bytes": 511}]
    return {"model": "m", "settings": settings, "corpus": {"digest": "d" * 64}, "environment": env} | {
        "positions": positions,
        "tail": tail,
        "passkey": passkey,
    }


def test_times_quality_rows_plot_and_report(tmp_path) -> None:
    policies = policy_grid((0.1,), ((2, 4),))
    cpu = torch.device("cpu")
    times = pareto.step_times(policies, tokens=512, sink=8, window=8, device=cpu, iters=2, repeats=2)
    by = {r["policy"]: r for r in times["rows"]}
    assert times["shape"]["N"] == 512 and set(by) == {p.name for p in policies}
    assert by["dense"]["us"] > 0 and by["dense"]["speedup_vs_dense"] == 1.0
    assert by["oracle@0.1"]["us"] is None and by["pages-16@0.1"]["us"] is None, "no kernel: no time"
    assert by["pq-M2-b4@0.1"]["mode"] == "eager" and by["streaming@0.1"]["us"] > 0
    assert times["cache_sets"] == 1 and "decode_step" in times["measures"], (
        "the user's path, no rotation on CPU"
    )
    generators = pareto.generator_quality(policies, tokens=512, sink=8, window=8, device=cpu, iters=2)
    assert {g["problem"] for g in generators} == {"workload", "needles"} and len(generators) == 8
    rows = pareto.combine(policies, times, generators, _tasks_doc())
    pq = next(r for r in rows if r["policy"] == "pq-M2-b4@0.1")
    assert pq["bpb_gap_512"] == 0.25 and pq["passkey_512"] == 0.5 and 0 < pq["mass_needles"] <= 1
    assert pq["se_bpb_gap_512"] == 0.01 and pq["se_passkey_512"] == 0.35, "the errors travel with them"
    oracle = next(r for r in rows if r["policy"] == "oracle@0.1")
    assert oracle["step_us"] is None and oracle["mass_workload"] >= pq["mass_workload"] - 1e-6
    png = tmp_path / "p.png"
    pareto.plot(rows, str(png), "test")
    assert png.stat().st_size > 0
    assert "pq-M2-b4@0.1" in pareto.format_table(rows)
    doc = {"rows": rows, "times": times, "generators": generators, "tasks": None}
    (tmp_path / "pareto-x.json").write_text(json.dumps(doc))
    (tmp_path / "tasks-x.json").write_text(json.dumps(_tasks_doc()))
    text = report.render(tmp_path, tmp_path)
    assert (
        "`pqattn pareto`" in text and "| pq-M2-b4@0.1 |" in text and "![pareto-x](pareto-x.png)" not in text
    )
    assert (
        "`pqattn tasks`" in text
        and "| 512 | 1.500 |" in text
        and "| pq-M2-b4@0.1 | +0.2500 ± 0.0100 | 0.700 | 0.500 ± 0.350 |" in text
    )


def test_cli_times_only_then_join(tmp_path) -> None:
    times = tmp_path / "times.json"
    common = ["--tokens", "256", "--densities", "0.1", "--pq", "2x3", "--sink", "8", "--window", "8"]
    common += [
        "--iters",
        "1",
        "--repeats",
        "1",
        "--device",
        "cpu",
        "--families",
        "pq-M2-b3-group-max-x2-rr2-s4",
    ]
    assert main(["pareto", "--times-only", *common]) == 2  # nowhere to write them: refused before measuring
    assert main(["pareto", "--times-only", "--json", str(times), *common]) == 0
    assert set(json.loads(times.read_text())) == {"times"}
    out = tmp_path / "p.json"
    assert main(["pareto", "--times", str(times), "--json", str(out), *common]) == 0
    doc = json.loads(out.read_text())
    assert doc["times"] == json.loads(times.read_text())["times"] and len(doc["rows"]) == 6
    group = next(r for r in doc["rows"] if r["family"] == "pq-M2-b3-group-max-x2-rr2-s4")
    assert group["step_us"] > 0 and 0 < group["mass_workload"] <= 1.5
    again = tmp_path / "q.json"  # new times, the quality of the earlier run
    assert main(["pareto", "--times", str(times), "--quality", str(out), "--json", str(again), *common]) == 0
    assert json.loads(again.read_text())["generators"] == doc["generators"]
    assert main(["pareto", "--pq", "2by3", "--device", "cpu"]) == 2
