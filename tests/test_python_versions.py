"""The Python versions the package declares: its sources compile under the lowest one that
`requires-python` admits and under the newest interpreter on the machine (syntax and the
compiler's warnings, in a subprocess of that interpreter). The test suite itself runs on the CI
machine's Python (3.11) and the GPU machines' (3.12)."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PYENV = Path.home() / ".pyenv" / "versions"
COMPILE_ALL = """
import pathlib, sys, warnings
warnings.simplefilter("error")  # an invalid escape or similar is an error under newer Pythons
bad = []
for root in sys.argv[1:]:
    for path in sorted(pathlib.Path(root).rglob("*.py")):
        try:
            compile(path.read_text(), str(path), "exec")
        except (SyntaxError, SyntaxWarning) as e:
            bad.append(f"{path}: {e}")
print("\\n".join(bad))
sys.exit(1 if bad else 0)
"""


def _pyproject() -> str:
    return (ROOT / "pyproject.toml").read_text()


def _lowest() -> tuple[int, int]:
    m = re.search(r'^requires-python = ">=\s*3\.(\d+)"$', _pyproject(), re.M)
    assert m, "requires-python: expected '>=3.N' in pyproject.toml"
    return 3, int(m.group(1))


def _interpreter(minor: int) -> str | None:
    """A working python3.<minor>: pyenv's newest build of it, else one on PATH (pyenv's shims
    are on PATH but run only the selected version, hence the trial run)."""
    builds = sorted(PYENV.glob(f"3.{minor}.*/bin/python3")) if PYENV.is_dir() else []
    for candidate in [*(str(b) for b in reversed(builds)), shutil.which(f"python3.{minor}")]:
        if candidate and subprocess.run([candidate, "-c", "pass"], capture_output=True).returncode == 0:
            return candidate
    return None


def _newest_minor() -> int | None:
    """The newest Python 3 minor version with an interpreter here (beyond the running one)."""
    minors = [m for m in range(sys.version_info.minor, 20) if _interpreter(m)]
    return max(minors) if minors else None


def test_classifiers_start_at_requires_python() -> None:
    declared = sorted(
        int(m) for m in re.findall(r'"Programming Language :: Python :: 3\.(\d+)"', _pyproject())
    )
    assert declared and declared[0] == _lowest()[1], (declared, _lowest())
    assert declared == list(range(declared[0], declared[-1] + 1)), "no gap between declared versions"
    assert sys.version_info[:2] >= _lowest(), "the running Python is below requires-python"


@pytest.mark.parametrize("which", ["lowest", "newest"])
def test_sources_compile_under(which: str) -> None:
    minor = _lowest()[1] if which == "lowest" else _newest_minor()
    python = _interpreter(minor) if minor is not None else None
    if python is None:
        pytest.skip(f"no {which} Python interpreter on this machine")
    dirs = [str(ROOT / d) for d in ("src", "tests", "bench")]
    done = subprocess.run([python, "-c", COMPILE_ALL, *dirs], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"{python}:\n{done.stdout}{done.stderr}"
