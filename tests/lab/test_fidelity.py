"""pqattn fidelity: quality rows against the oracle, build objectives and step rows, on a CPU."""

from __future__ import annotations

import pytest

from pqattn.lab import fidelity
from pqattn.lab.policies import Policy, group_select, head_select


def test_quality_and_build_rows(device):
    """Every policy gets its mass share per generator (the oracle's is 1), every index its
    objective (a sampled build's too)."""
    policies = [
        Policy("oracle", 0.02),
        Policy("pq", 0.02, subvectors=16, bits=4, select=group_select("max", 2)),
        Policy("pq", 0.02, subvectors=16, bits=4, select=head_select(2), sample=4),
    ]
    doc = fidelity.run(
        density=0.02, quality_tokens=[1024], shapes=[], sink=16, window=16, device=device, policies=policies
    )
    asked = [r for r in doc["quality"] if not r["yardstick"]]
    shares = {(r["policy"], r["problem"]): r["mass_share"] for r in asked}
    assert len(shares) == 6 and all(0.0 < v <= 1.0 + 1e-6 for v in shares.values())
    assert shares[("oracle@0.02", "needles")] == 1.0
    # the equal-bytes yardsticks: the group max at 2 heavies and the per-head oracle at 0.04
    sticks = {r["policy"] for r in doc["quality"] if r["yardstick"]}
    assert sticks == {"oracle-group-max-x2@0.02", "oracle@0.04"}
    for r in asked:
        assert r["share_equal_rows"] is not None and r["share_equal_tokens"] is not None
        assert r["share_equal_tokens"] <= r["mass_share"] + 1e-9  # twice the oracle's tokens or the same
    group = next(r for r in asked if "group" in r["policy"] and r["problem"] == "needles")
    exact = {(r["policy"], r["problem"]): r["mass"] for r in doc["quality"]}
    assert group["share_equal_rows"] == group["mass"] / exact[("oracle-group-max-x2@0.02", "needles")]
    assert {(r["M"], r["bits"], r["sample"]) for r in doc["builds"]} == {(16, 4, 0), (16, 4, 4)}
    assert all(0.0 < r["rel_sq_error"] < 1.0 for r in doc["builds"])
    assert doc["steps"] == [] and "equal tokens/head" in fidelity.format_table(doc)


def test_step_rows_time_the_kernel_policies(kernel_routes, device):
    """A group re-rank policy's selection and step beside SDPA, with the selection's bytes floor."""
    if device.type == "cuda":
        pytest.skip("the GPU run is `pqattn fidelity` itself")
    policy = Policy("pq", 0.02, subvectors=8, bits=4, select=group_select("max", 2, rerank=2))
    rows = fidelity.step_rows(
        [policy], batch=1, tokens=256, sink=8, window=8, device=device, bandwidth=1e11, repeats=1
    )
    assert [r["policy"] for r in rows] == ["dense", policy.name]
    assert rows[1]["route"] == "fine" and rows[1]["step_us"] > 0 and rows[1]["select_floor_us"] > 0


def test_named_policies_parse_the_families():
    """Every family name parses back to its policy; the oracle comes first; bad names are refused."""
    policies = fidelity.default_policies(0.02) + fidelity.code_policies(0.02)
    names = ",".join(p.family for p in policies)
    assert fidelity.named_policies(names, 0.02)[: len(policies)] == policies
    got = fidelity.named_policies("pq-M32-b4-group-max-x4-rr2", 0.05)
    assert got == [
        Policy("oracle", 0.05),
        Policy("pq", 0.05, subvectors=32, bits=4, select=group_select("max", 4, rerank=2)),
    ]
    assert fidelity.named_policies("dense,pages-16", 0.02)[1:] == [Policy("dense"), Policy("pages", 0.02)]
    with pytest.raises(ValueError, match="policy"):
        fidelity.named_policies("pq-M16", 0.02)


def test_the_report_shows_the_equal_bytes_yardsticks(device):
    """The results page's fidelity section: a table of tokens per head and the shares of the
    equal-bytes yardsticks for the policies asked (the yardsticks' own rows left out)."""
    from pqattn.lab.report import _fidelity_section

    group = Policy("pq", 0.02, subvectors=8, bits=4, select=group_select("max", 2))
    policies = [Policy("oracle", 0.02), group]
    doc = fidelity.run(
        density=0.02, quality_tokens=[512], shapes=[], sink=8, window=8, device=device, policies=policies
    )
    text = "\n".join(_fidelity_section("fidelity.json", doc))
    assert "of exact top-k, equal rows" in text and "of exact top-k, equal tokens / head" in text
    equal_table = text.split("equal tokens / head |")[1]
    assert "pq-M8-b4-group-max-x2@0.02" in equal_table and "oracle@0.04" not in equal_table
