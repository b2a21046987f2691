"""The demo end to end at a reduced size, and its command line."""

from __future__ import annotations

import json

import pytest
import torch

from pqattn.cli import main
from pqattn.index import PQConfig
from pqattn.lab.demo import format_table, run_demo, variant_configs
from pqattn.lab.report import _demo_section
from pqattn.lab.workload import WorkloadSpec, make_workload, rope

SMALL = WorkloadSpec(tokens=4096, kv_heads=2, group=4, head_dim=64, steps=3, topics=8)
SMALL_CFG = PQConfig(sink=32, window=32, heavy=96, iters=8)


def test_demo_runs_and_pq_beats_streaming() -> None:
    result = run_demo(SMALL, SMALL_CFG, device=torch.device("cpu"), dtype=torch.float32, repeats=3)
    rows = {r["method"]: r for r in result["results"]}
    assert set(rows) == {"pq", "pq-host", "streaming", "oracle", "dense"}
    for r in rows.values():
        for key in (
            "tokens",
            "attention_mass",
            "oracle_recall",
            "output_rel_err",
            "step_us",
            "speedup_vs_dense",
        ):
            assert r[key] == r[key] and r[key] >= 0, (r["method"], key)
    # the default group selection keeps G per-head heavies: about the per-head oracle's mass
    assert rows["pq"]["attention_mass"] > 0.9 * rows["oracle"]["attention_mass"]
    assert rows["pq"]["attention_mass"] > rows["streaming"]["attention_mass"] + 0.1
    assert rows["oracle"]["oracle_recall"] == 1.0 and rows["streaming"]["oracle_recall"] == 0.0
    assert rows["pq"]["output_rel_err"] < rows["streaming"]["output_rel_err"]
    assert rows["pq"]["tokens"] == 32 + 4 * 96 + 32 and rows["oracle"]["tokens"] == 32 + 96 + 32
    # the cache in host memory: the same lists and attention, its own steps
    for key in ("tokens", "attention_mass", "oracle_recall"):
        assert rows["pq-host"][key] == pytest.approx(rows["pq"][key], abs=1e-6), key
    assert rows["pq-host"]["output_rel_err"] == pytest.approx(rows["pq"]["output_rel_err"], rel=1e-3)
    table = format_table(result)
    assert "pq" in table and "streaming" in table and "oracle" in table


def test_cli_demo_json(tmp_path, capsys) -> None:
    path = tmp_path / "demo.json"
    args = [
        "demo",
        "--device",
        "cpu",
        "--tokens",
        "1024",
        "--kv-heads",
        "1",
        "--group",
        "2",
        "--head-dim",
        "32",
        "--steps",
        "2",
        "--sink",
        "8",
        "--window",
        "8",
        "--heavy",
        "32",
        "--repeats",
        "2",
        "--json",
        str(path),
    ]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "oracle recall" in out and "lab.workload" in out and "lab.needles" in out
    runs = json.loads(path.read_text())["runs"]
    assert [r["generator"] for r in runs] == ["workload", "needles"]
    for data in runs:
        assert data["environment"]["torch"] == torch.__version__
        assert [r["method"] for r in data["results"]] == [
            "pq",
            "pq-faithful",
            "pq-coarse",
            "pq-host",
            "streaming",
            "oracle",
            "dense",
        ]
    assert main([*args, "--generators", "needles"]) == 0
    assert json.loads(path.read_text())["generator"] == "needles"
    assert main([*args, "--generators", "nothing"]) == 2
    assert main([*args, "--generators", "needles", "--variants", "", "--share", "head"]) == 0
    data = json.loads(path.read_text())
    assert [r["method"] for r in data["results"]] == ["pq", "streaming", "oracle", "dense"]
    assert data["config"]["share"] == "head" and data["variants"] == {}
    # ip: the faithful variant shares the default's codebook, phi included
    assert main([*args, "--generators", "workload", "--variants", "faithful", "--metric", "ip"]) == 0
    rows = {r["method"]: r for r in json.loads(path.read_text())["results"]}
    assert rows["pq-faithful"]["attention_mass"] >= rows["pq"]["attention_mass"] - 0.05


def test_cli_reports_bad_arguments(capsys) -> None:
    assert main(["demo", "--device", "cpu", "--bits", "9", "--tokens", "256"]) == 2
    assert "bits" in capsys.readouterr().err


def test_workload_structure() -> None:
    spec = WorkloadSpec(tokens=2048, kv_heads=2, group=2, head_dim=32, steps=2, topics=4)
    w = make_workload(spec)
    assert w.keys.shape == (1, 2, 2050, 32) and w.queries.shape == (2, 1, 4, 32)
    logits = torch.einsum("bhd,bknd->bhn", w.queries[0], w.keys[:, [0, 0, 1, 1], :2048]) / 32**0.5
    p = logits.softmax(-1)
    assert float(p[..., 0].mean()) > 0.05, "token 0 should be an attention sink"
    top = p.topk(32, dim=-1).values.sum(-1)
    assert float(top.mean()) > 0.3, "a few tokens should carry much of the mass"
    assert torch.equal(make_workload(spec).keys, w.keys), "workload must be deterministic"


def test_rope_is_a_rotation_with_relative_phase() -> None:
    x = torch.randn(5, 16, dtype=torch.float64)
    y = torch.randn(5, 16, dtype=torch.float64)
    pos = torch.arange(5)
    rx = rope(x, pos, 10000.0)
    assert torch.allclose(rx.norm(dim=-1), x.norm(dim=-1))
    # <rope(x, i), rope(y, j)> depends on i - j only
    a = (rope(x[:1], torch.tensor([7]), 10000.0) * rope(y[:1], torch.tensor([3]), 10000.0)).sum()
    b = (rope(x[:1], torch.tensor([104]), 10000.0) * rope(y[:1], torch.tensor([100]), 10000.0)).sum()
    assert torch.allclose(a, b)


def test_gpu_step_times_show_when_measured() -> None:
    """A CPU run has no GPU times (no columns for them); a run with graph timings shows them in
    the demo's table and in the README's results section."""
    result = run_demo(SMALL, SMALL_CFG, device=torch.device("cpu"), dtype=torch.float32, repeats=2)
    assert all(r["step_gpu_us"] is None and r["gpu_speedup_vs_dense"] is None for r in result["results"])
    header = next(line for line in format_table(result).splitlines() if line.startswith("method"))
    assert "GPU time" not in header
    assert "On a CPU pqattn runs its PyTorch reference" in " ".join(format_table(result).split())
    for r, us in zip(result["results"], (4.0, 8.0, None, None, 20.0), strict=True):
        r["step_gpu_us"], r["gpu_speedup_vs_dense"] = us, None if us is None else 20.0 / us
    table = format_table(result)
    header = next(line for line in table.splitlines() if line.startswith("method"))
    assert "GPU time" in header and "5.00x" in table and "4.0 us" in table
    verdict = " ".join(table.split("verdict")[1].split())
    assert verdict.startswith("(GPU time,") and "faster than dense: pq (5.00x, mass" in verdict
    assert "PyTorch reference" not in verdict
    section = "\n".join(_demo_section("demo.json", result))
    assert "step us (GPU)" in section and "| 5.00x |" in section


def test_the_variants_beside_the_default() -> None:
    """variants: pq-faithful (the config with an exact re-rank, sharing its build) and pq-coarse
    (M=2, 6 bits per query head) beside pq: the faithful one keeps at least the default's
    attention mass, the coarse one less, on the LLM-like cache."""
    spec = WorkloadSpec(tokens=4096, kv_heads=2, group=4, head_dim=64, steps=2, topics=8)
    cfg = PQConfig(sink=16, window=16, heavy=96, iters=4)
    variants = variant_configs(cfg)
    assert list(variants) == ["pq-faithful", "pq-coarse"]
    result = run_demo(
        spec, cfg, device=torch.device("cpu"), dtype=torch.float32, repeats=2, variants=variants
    )
    rows = {r["method"]: r for r in result["results"]}
    assert list(rows) == ["pq", "pq-faithful", "pq-coarse", "pq-host", "streaming", "oracle", "dense"]
    assert rows["pq-faithful"]["tokens"] == rows["pq"]["tokens"] == 16 + 4 * 96 + 16
    assert rows["pq-coarse"]["tokens"] == 16 + 96 + 16
    assert rows["pq-faithful"]["attention_mass"] >= rows["pq"]["attention_mass"] - 0.01
    assert rows["pq"]["attention_mass"] > rows["pq-coarse"]["attention_mass"]
    assert result["variants"]["pq-faithful"]["rerank"] == 2 and result["variants"]["pq-coarse"]["bits"] == 6
    table = format_table(result)
    assert "pq-faithful: M=16, 8 bits" in table and "exact re-rank of 2" in table
    assert "pq-coarse: M=2, 6 bits, euclidean, on every key; one selection per query head of 96 rows" in table
    with pytest.raises(ValueError, match=r"variants.*nothing"):
        variant_configs(cfg, ("nothing",))
