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
    shares = {(r["policy"], r["problem"]): r["mass_share"] for r in doc["quality"]}
    assert len(shares) == 6 and all(0.0 < v <= 1.0 + 1e-6 for v in shares.values())
    assert shares[("oracle@0.02", "needles")] == 1.0
    assert {(r["M"], r["bits"], r["sample"]) for r in doc["builds"]} == {(16, 4, 0), (16, 4, 4)}
    assert all(0.0 < r["rel_sq_error"] < 1.0 for r in doc["builds"])
    assert doc["steps"] == [] and "mass share" in fidelity.format_table(doc)


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
