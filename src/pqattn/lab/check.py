"""`pqattn check`: fuzz every Triton kernel against its reference, over its whole autotune space.

Each kernel family contributes a `KernelCheck` (registered in `pqattn.lab.kernel_checks`): the
configs of its autotune space, a way to draw a random case (shapes, dtypes, options), the kernel
forced to one config, the reference, and a comparison with the tolerances for the case's dtype.
Every config sees fresh random cases (not only the config the autotuner would pick), and every
allocation the kernel makes is filled with NaN (floats) or the type's maximum (integers) first,
so an element it fails to write is caught.
On a CPU the kernels run under the Triton interpreter on small shapes; on a GPU compiled, large.
"""

from __future__ import annotations

import contextlib
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class KernelCheck:
    name: str
    configs: Callable[[], Sequence[dict]]  # every config of the autotune space, as launcher kwargs
    draw: Callable[[torch.Generator, torch.device, bool], dict]  # (gen, device, large) -> one case
    run: Callable[[dict, dict], object]  # (case, config) -> the kernel's output
    reference: Callable[[dict], object]  # case -> the reference's output
    compare: Callable[[dict, object, object], str | None]  # (case, out, ref) -> None or what is wrong
    # (case, config) -> whether the config serves the case; cases it does not serve are redrawn
    fits: Callable[[dict, dict], bool] = lambda case, config: True


def _poison(t: torch.Tensor) -> torch.Tensor:
    if t.is_floating_point():
        return t.fill_(float("nan"))
    if t.dtype != torch.bool and not t.is_complex():
        return t.fill_(torch.iinfo(t.dtype).max)
    return t


@contextlib.contextmanager
def poisoned_allocations() -> Iterator[None]:
    """Within the block, torch.empty / empty_like return NaN- (or max-int-) filled tensors."""
    empty, empty_like = torch.empty, torch.empty_like
    torch.empty = lambda *a, **k: _poison(empty(*a, **k))
    torch.empty_like = lambda *a, **k: _poison(empty_like(*a, **k))
    try:
        yield
    finally:
        torch.empty, torch.empty_like = empty, empty_like


def _label(config: dict) -> str:
    return ",".join(f"{k}={v}" for k, v in config.items()) or "default"


def run_checks(
    checks: Sequence[KernelCheck],
    *,
    device: torch.device,
    large: bool,
    cases: int,
    seed: int,
    log=None,
) -> list[dict]:
    """One row per (kernel, config): how many random cases ran and failed, the first failure."""
    rows = []
    for check in checks:
        for ci, config in enumerate(check.configs()):
            failures, first, t0 = 0, None, time.perf_counter()
            for i in range(cases):
                gen = torch.Generator(device="cpu").manual_seed(seed * 1_000_003 + ci * 1009 + i)
                case = check.draw(gen, device, large)
                while not check.fits(case, config):
                    case = check.draw(gen, device, large)
                try:
                    with poisoned_allocations():
                        out = check.run(case, config)
                    problem = check.compare(case, out, check.reference(case))
                except Exception as e:  # a crash in one config is a finding, not the end of the run
                    problem = f"{type(e).__name__}: {e}".splitlines()[0]
                    if log is not None:
                        traceback.print_exc(file=log)
                if problem is not None:
                    failures += 1
                    first = first or f"case {case.get('desc', i)}: {problem}"
            rows.append(
                {
                    "kernel": check.name,
                    "config": _label(config),
                    "cases": cases,
                    "failures": failures,
                    "first_failure": first,
                    "seconds": time.perf_counter() - t0,
                }
            )
            if log is not None:
                status = "ok" if failures == 0 else f"{failures} FAILED"
                print(f"{check.name} [{_label(config)}]: {cases} cases, {status}", file=log, flush=True)
    return rows


def format_rows(rows: list[dict], *, device: torch.device, seed: int) -> str:
    if not rows:
        return f"pqattn check on {device}: no Triton kernel is registered"
    lines = [f"pqattn check on {device} (seed {seed})"]
    head = ("kernel", "config", "cases", "failed", "s", "first failure")
    table = [head] + [
        (
            r["kernel"],
            r["config"],
            str(r["cases"]),
            str(r["failures"]),
            f"{r['seconds']:.1f}",
            r["first_failure"] or "",
        )
        for r in rows
    ]
    widths = [max(len(row[i]) for row in table) for i in range(len(head) - 1)]
    for row in table:
        lines.append("  ".join(c.ljust(w) for c, w in zip(row[:-1], widths, strict=True)) + "  " + row[-1])
    bad = sum(r["failures"] > 0 for r in rows)
    kernels = len({r["kernel"] for r in rows})
    lines.append(
        f"{len(rows)} configs of {kernels} kernel(s): "
        + ("all passed" if not bad else f"{bad} config(s) FAILED")
    )
    return "\n".join(lines)
