"""Progress lines: rewritten in place on a terminal, nothing elsewhere."""

from __future__ import annotations

import functools
import io
import sys

import torch

from pqattn import dispatch, ops
from pqattn.runtime.progress import Progress


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_rewrites_one_line_on_a_terminal_and_clears_it() -> None:
    out = _Terminal()
    with Progress("tasks: tail", 3, stream=out, every=0.0) as tick:
        tick(1, "policy pq")
        tick(3)
    text = out.getvalue()
    assert "\rtasks: tail: 0/3" in text and "\rtasks: tail: 1/3 policy pq" in text and "3/3" in text
    assert text.endswith("\r") and "\n" not in text  # cleared, no line left behind
    unknown = _Terminal()
    with Progress("demo: indexing 4096 tokens", stream=unknown):
        pass
    assert "demo: indexing 4096 tokens ..." in unknown.getvalue()


def test_progress_is_silent_off_a_terminal() -> None:
    out = io.StringIO()
    with Progress("train", 10, stream=out, every=0.0) as tick:
        for step in range(1, 11):
            tick(step)
    assert out.getvalue() == ""


def test_progress_rate_limits_but_shows_the_last_count() -> None:
    out = _Terminal()
    tick = Progress("bench", 100, stream=out, every=3600.0)
    tick(0)
    for done in range(1, 100):
        tick(done)
    assert out.getvalue().count("\r") == 1
    tick(100)
    assert "100/100" in out.getvalue()


def test_progress_waits_out_its_delay() -> None:
    out = _Terminal()
    with Progress("build", 4, stream=out, every=0.0, delay=3600.0) as tick:
        for i in range(1, 5):
            tick(i)
    assert out.getvalue() == "", "work shorter than the delay shows nothing"


def test_a_reference_index_build_ticks_once_per_iteration(monkeypatch) -> None:
    """The CPU build's progress line advances with the Lloyd iterations (the terminal faked)."""
    out = _Terminal()
    monkeypatch.setattr(sys, "stderr", out)
    monkeypatch.setattr(Progress, "__init__", functools.partialmethod(Progress.__init__, every=0.0))
    monkeypatch.setattr(dispatch, "BUILD_PROGRESS_DELAY", 0.0)
    ops.build_index(torch.randn(1, 2, 300, 16), subvectors=2, bits=4, iters=3, tol=0.0)
    text = out.getvalue()
    assert "pqattn: index build of 1x2x300 keys, k-means: 3/3" in text and text.endswith("\r")
