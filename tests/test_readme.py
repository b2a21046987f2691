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


def test_transformers_example_runs(monkeypatch, capsys) -> None:
    """The README's transformers example, as written but for a shorter prompt and fewer tokens,
    on the committed model: sparse decoding from a prompt the policy does not keep whole."""
    code = re.search(r"## Hugging Face transformers\n\n```python\n(.*?)```", README.read_text(), re.S).group(
        1
    )
    assert "[:8192]" in code and "max_new_tokens=32" in code
    code = code.replace("[:8192]", "[:2048]").replace("max_new_tokens=32", "max_new_tokens=4")
    monkeypatch.chdir(README.parent)
    scope: dict = {}
    exec(compile(code, "README transformers example", "exec"), scope)
    assert scope["out"].shape == (1, 2048 + 4) and capsys.readouterr().out.strip()
    heavy = scope["pq_hf"].HFConfig(heavy_fraction=0.02).heavy_for(2048)
    assert 64 + 64 + 4 * heavy < 2048, "the selection keeps a share of the prompt"
