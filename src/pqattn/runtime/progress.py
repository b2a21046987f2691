"""Progress of long work (the lab's suites, training, an index build on the CPU): one line on
stderr, rewritten in place while the work runs and cleared when it ends; silent when stderr is not
a terminal, so logs and CI keep the results only."""

from __future__ import annotations

import sys
import time
from typing import TextIO


class Progress:
    """`with Progress("tasks: tail", total=8) as tick: ... tick(done, "note")`.

    Lines are rewritten at most every `every` seconds (the last one always) and only once `delay`
    seconds have passed (work that ends sooner shows nothing); `stream` defaults to stderr, and
    nothing is written unless it is a terminal.
    """

    def __init__(
        self,
        what: str,
        total: int | None = None,
        *,
        stream: TextIO | None = None,
        every: float = 0.5,
        delay: float = 0.0,
    ):
        self.what, self.total, self.every, self.delay = what, total, every, delay
        self.stream = sys.stderr if stream is None else stream
        self.live = bool(getattr(self.stream, "isatty", lambda: False)())
        self.start = time.perf_counter()
        self._shown = -float("inf")
        self._width = 0

    def __call__(self, done: int, note: str = "") -> None:
        now = time.perf_counter()
        last = self.total is not None and done >= self.total
        if not self.live or now - self.start < self.delay or (now - self._shown < self.every and not last):
            return
        self._shown = now
        count = f": {done}/{self.total}" if self.total is not None else " ..."
        line = f"{self.what}{count}{' ' + note if note else ''} ({now - self.start:.0f} s)"
        self.stream.write("\r" + line.ljust(self._width))
        self.stream.flush()
        self._width = len(line)

    def __enter__(self) -> Progress:
        self(0)
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Clear the line (the work is done)."""
        if self.live and self._width:
            self.stream.write("\r" + " " * self._width + "\r")
            self.stream.flush()
            self._width = 0
