"""The README's quickstart runs as written (at a smaller N)."""

from __future__ import annotations

import re
from pathlib import Path

import torch

README = Path(__file__).resolve().parents[1] / "README.md"


def test_quickstart_runs() -> None:
    code = re.search(r"## Quickstart\n\n```python\n(.*?)```", README.read_text(), re.S).group(1)
    assert "16384" in code
    scope: dict = {}
    exec(compile(code.replace("16384", "1024"), "README quickstart", "exec"), scope)
    assert scope["out"].shape == (1, 32, 128) and torch.isfinite(scope["out"]).all()
    assert int(scope["sel"].counts[0, 0]) == 128 + 256 + 128
