"""docs/usage.md's code blocks run as written, in order, in one scope (a block that starts with
`# needs: cuda` on a GPU only; `# needs: torchrun` under torchrun only: bench/tp_generate.py and
tests/integrations/test_tensor_parallel.py run the same calls)."""

from __future__ import annotations

import re
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
USAGE = ROOT / "docs" / "usage.md"


def _blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", USAGE.read_text(), re.S)


def test_every_block_names_what_it_needs_or_runs_anywhere() -> None:
    needs = [b.splitlines()[0] for b in _blocks() if b.startswith("# needs:")]
    assert len(_blocks()) >= 7 and all(n.split()[2] in ("cuda", "torchrun") for n in needs), needs


def test_usage_blocks_run_as_written(monkeypatch) -> None:
    monkeypatch.chdir(ROOT)
    scope: dict = {}
    ran = []
    for i, code in enumerate(_blocks()):
        need = code.splitlines()[0].split()[2] if code.startswith("# needs:") else None
        if need == "cuda" and not torch.cuda.is_available():
            continue
        if need == "torchrun":
            continue
        exec(compile(code, f"docs/usage.md block {i + 1}", "exec"), scope)
        ran.append(i)
        out = scope.get("out")
        assert out is None or bool(torch.isfinite(out.float()).all()), f"block {i + 1}"
    assert len(ran) >= 5
    assert scope["continuations"].shape == (2, 16)  # the ragged batch's 16 new tokens each
    assert 0.0 <= scope["cache"].hit_rate() <= 1.0
    if torch.cuda.is_available():
        assert scope["index"].lengths.tolist() != []
