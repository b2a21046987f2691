"""`pqattn check`: the fuzz harness catches wrong, partial and crashing kernels, config by config."""

from __future__ import annotations

import pytest
import torch

from pqattn.cli import main
from pqattn.lab import kernel_checks
from pqattn.lab.check import KernelCheck, format_rows, poisoned_allocations, run_checks


def _draw(gen: torch.Generator, device: torch.device, large: bool) -> dict:
    n = int(torch.randint(5, 40 if not large else 400, (1,), generator=gen))
    return {"x": torch.randn(n, generator=gen).to(device), "desc": f"n={n}"}


def _compare(case: dict, out: torch.Tensor, ref: torch.Tensor) -> str | None:
    bad = ~torch.isclose(out, ref)
    return None if not bad.any() else f"{int(bad.sum())} of {bad.numel()} elements differ"


def _kernel(case: dict, config: dict) -> torch.Tensor:
    """A stand-in kernel: doubles x in blocks of BLOCK; `bug` breaks it in a chosen way."""
    x = case["x"]
    out = torch.empty_like(x)
    block = config["BLOCK"]
    for start in range(0, len(x), block):
        end = start + block if config.get("bug") != "skip_tail" else min(start + block, len(x) - 1)
        out[start:end] = 2 * x[start:end]
    if config.get("bug") == "wrong":
        out[0] += 1
    if config.get("bug") == "crash":
        raise RuntimeError("misaligned address")
    return out


def make_check(configs: list[dict]) -> KernelCheck:
    return KernelCheck("double", lambda: configs, _draw, _kernel, lambda c: 2 * c["x"], _compare)


def test_every_config_is_run_and_each_bug_is_caught() -> None:
    configs = [
        {"BLOCK": 4},
        {"BLOCK": 16},
        {"BLOCK": 8, "bug": "skip_tail"},
        {"BLOCK": 8, "bug": "wrong"},
        {"BLOCK": 8, "bug": "crash"},
    ]
    rows = run_checks([make_check(configs)], device=torch.device("cpu"), large=False, cases=4, seed=1)
    assert [r["config"] for r in rows] == [
        "BLOCK=4",
        "BLOCK=16",
        "BLOCK=8,bug=skip_tail",
        "BLOCK=8,bug=wrong",
        "BLOCK=8,bug=crash",
    ]
    assert [r["failures"] for r in rows] == [0, 0, 4, 4, 4]
    assert rows[2]["first_failure"].startswith("case n=")  # the unwritten tail is NaN, not stale memory
    assert "misaligned address" in rows[4]["first_failure"]
    text = format_rows(rows, device=torch.device("cpu"), seed=1)
    assert "3 config(s) FAILED" in text


def test_poisoned_allocations_are_restored() -> None:
    empty = torch.empty
    with poisoned_allocations():
        assert torch.empty(3).isnan().all()
        assert (torch.empty_like(torch.zeros(2, dtype=torch.int32)) == 2**31 - 1).all()
    assert torch.empty is empty


def test_cli_check_exit_codes(monkeypatch, capsys) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(kernel_checks, "registered", lambda: [make_check([{"BLOCK": 4}])])
    assert main(["check", "--device", "cpu", "--seed", "3"]) == 0
    assert "all passed" in capsys.readouterr().out
    monkeypatch.setattr(kernel_checks, "registered", lambda: [make_check([{"BLOCK": 4, "bug": "wrong"}])])
    assert main(["check", "--device", "cpu", "--cases", "2"]) == 1
    assert main(["check", "--device", "cpu", "--kernel", "nosuch"]) == 2


def test_cli_check_needs_the_interpreter_on_cpu(monkeypatch, capsys) -> None:
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert main(["check", "--device", "cpu"]) == 2
    assert "TRITON_INTERPRET" in capsys.readouterr().err


@pytest.mark.parametrize("large", [False, True])
def test_registered_kernels_pass(large: bool, device: torch.device) -> None:
    """Every real kernel's check, every config: the same fuzz `pqattn check` runs (small on CPU)."""
    if large and device.type != "cuda":
        pytest.skip("large shapes run compiled on the GPU")
    seed = torch.initial_seed() % 2**31  # from PQATTN_SEED and the test's id (conftest): replayable
    rows = run_checks(kernel_checks.registered(), device=device, large=large, cases=2, seed=seed)
    failed = [r for r in rows if r["failures"]]
    assert not failed, (f"run_checks seed={seed} large={large}", failed)


def test_the_build_check_catches_an_objective_off_by_more_than_rounding() -> None:
    """kmeans_build's rule that the last objective is the sum of the squared distances to the
    returned centres: the float64 reference passes it, for both metrics (ip with its augmented
    coordinate's float32 allowance), and 1% off fails it."""
    from pqattn.lab import kernel_checks as kc

    for seed in range(40):
        case = kc._draw_build(torch.Generator().manual_seed(seed), torch.device("cpu"), False)
        want = kc._reference_index_build(case)
        assert kc._compare_build(case, want, want) is None, case["desc"]
        if float(want.objective[-1].min()) > 1.0:  # (not a group of as many centres as points)
            wrong = want._replace(
                objective=want.objective
                * torch.tensor([1.0] * (len(want.objective) - 1) + [1.01]).view(-1, 1, 1, 1)
            )
            assert "last objective" in (kc._compare_build(case, wrong, want) or ""), case["desc"]


@pytest.mark.parametrize("rule", ["sum", "max"])
def test_group_selection_slack_is_the_rounding_a_kernel_may_take(rule: str) -> None:
    """The slack of a group selection's check: zero where every LUT entry is a bfloat16 value
    (small integers), and a midpoint entry's two roundings' gap where one lies exactly between
    two bfloat16 values (257, between 256 and 258) on a token's code."""
    q = torch.zeros(1, 2, 2)  # two heads of one KV head
    q[..., 0] = 1.0 if rule == "max" else 0.5  # the sum rule's summed query is [1, 0]
    cents = torch.zeros(1, 1, 1, 4, 2)  # M = 1, C = 4
    cents[..., :, 0] = torch.tensor([3.0, -5.0, 7.0, 11.0])
    codes = torch.tensor([0, 1, 2, 3, 2], dtype=torch.uint8).view(1, 1, 5, 1)
    scores, slack = kernel_checks.group_selection_scores(q, cents, codes, rule)
    assert slack == 0.0
    assert scores.flatten().tolist() == [3.0, -5.0, 7.0, 11.0, 7.0]
    cents[0, 0, 0, 2, 0] = 257.0
    scores, slack = kernel_checks.group_selection_scores(q, cents, codes, rule)
    assert slack == 2.0
    assert float(scores[0, 0, 2]) == 256.0  # (ties to even)
