"""Shared test set-up.

* Every test draws fresh random inputs: the session seed comes from PQATTN_SEED or is drawn at
  start and printed in the header and after a failure, so a failure can be replayed with
  PQATTN_SEED=<seed>.
* torch.empty / empty_like hand out NaN-filled float tensors (and int tensors full of a sentinel)
  so that an output element nobody wrote fails comparisons instead of passing by luck.
"""

from __future__ import annotations

import os
import random
import zlib
from collections.abc import Iterator

import pytest
import torch

from pqattn import dispatch
from pqattn.lab.check import poisoned_allocations
from pqattn.runtime.launch import PlanCache, interpreted

SEED = int(os.environ.get("PQATTN_SEED", random.SystemRandom().randrange(1 << 31)))
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def pytest_report_header(config: pytest.Config) -> str:
    return (
        f"pqattn: PQATTN_SEED={SEED}, device={DEVICE}, TRITON_INTERPRET={os.environ.get('TRITON_INTERPRET')}"
    )


def pytest_terminal_summary(terminalreporter, exitstatus: int, config: pytest.Config) -> None:
    # -q hides the header, and CI logs keep only the tail: repeat the seed where a failure is read
    if exitstatus != 0:
        terminalreporter.write_line(f"replay with PQATTN_SEED={SEED}")


@pytest.fixture(autouse=True)
def _fresh_seed(request: pytest.FixtureRequest) -> None:
    torch.manual_seed(SEED ^ zlib.crc32(request.node.nodeid.encode()))


@pytest.fixture(autouse=True)
def _nan_poison_empty() -> Iterator[None]:
    with poisoned_allocations():
        yield


@pytest.fixture
def device() -> torch.device:
    return DEVICE


@pytest.fixture
def kernel_routes(monkeypatch, device: torch.device) -> None:
    """PQIndex and the functional API take the Triton kernels: on a GPU as they do, on a CPU under
    the interpreter."""
    if device.type != "cuda":
        if not interpreted():
            pytest.skip("CPU tensors run the kernels under Triton's interpreter only")
        monkeypatch.setattr(dispatch, "KERNEL_DEVICES", ("cuda", "cpu"))
        monkeypatch.setattr(dispatch, "PLANS", PlanCache(dispatch.PLANS.size))  # they end with the test
