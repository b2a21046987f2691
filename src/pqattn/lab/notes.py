"""The design notes' figures and citations, checked by `pqattn report` (`--check`).

A figure in a note (docs/**/*.md, the README) is tied to the JSON it comes from by an HTML comment
right after it, invisible once rendered:

    a token took 33.1<!-- host-tier-512k-programs-NVIDIA_H100.json parts/large/0/ms_per_token .1f --> ms

The comment names a results file (looked up in bench/results, then bench/quality), a path into it
and a format: path segments are dict keys, list indices, or `key=value[,key=value]` (the first
list element whose keys have those values); the format is a Python format spec, optionally scaled first
(`*1e-3:.1f`). `pqattn report` rewrites the figure from the JSON and `--check` fails when the
text differs. Every file a note cites by path (bench/, docs/, src/, tests/, models/, pqattn/) or
by a results name (`*-NVIDIA_H100.json`) must exist.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

FIGURE = re.compile(
    r"(?P<shown>[-+]?\d[\d,]*(?:\.\d+)?)<!-- (?P<file>[\w.-]+\.json) (?P<path>\S+) (?P<fmt>\S+) -->"
)
CITATION = re.compile(
    r"(?<![\w/.}-])(?P<path>(?:bench|docs|src|tests|models|pqattn)/[\w/.-]*\w\.(?:py|json|md|sh|png))"
    r"|(?<![\w/.}-])(?P<name>[\w.-]+-NVIDIA_H[12]00\.(?:json|png))"
)
# every comment that names a results file (not in a code span), parsed or not: one that FIGURE
# does not match is an error
TIE = re.compile(r"(?<!`)<!-- [\w.-]+\.json\b.*?-->")
RESULTS_DIRS = ("bench/results", "bench/quality")


def note_files(root: Path) -> list[Path]:
    """The notes: the README and every markdown file under docs/."""
    return [root / "README.md", *sorted((root / "docs").rglob("*.md"))]


def _locate(root: Path, name: str) -> Path | None:
    for folder in RESULTS_DIRS:
        if (root / folder / name).is_file():
            return root / folder / name
    return None


def _value(doc: object, path: str, where: str) -> float:
    """The number at `path` ('/'-separated: keys, indices, key=value) in a JSON document."""
    node = doc
    for seg in path.split("/"):
        if isinstance(node, list) and "=" in seg:
            wants = [cond.split("=", 1) for cond in seg.split(",")]
            found = [x for x in node if isinstance(x, dict) and all(str(x.get(k)) == v for k, v in wants)]
            if not found:
                raise ValueError(f"{where}: no element with {seg} in {path!r}")
            node = found[0]
        elif isinstance(node, list) and seg.lstrip("-").isdigit():
            node = node[int(seg)]
        elif isinstance(node, dict) and seg in node:
            node = node[seg]
        else:
            raise ValueError(f"{where}: {seg!r} of {path!r} is not in the document")
    if not isinstance(node, int | float) or isinstance(node, bool):
        raise ValueError(f"{where}: {path!r} is {node!r}, expected a number")
    return float(node)


def _format(value: float, fmt: str, where: str) -> str:
    scale = 1.0
    if fmt.startswith("*"):
        factor, _, fmt = fmt[1:].partition(":")
        scale = float(factor)
    try:
        return format(value * scale, fmt)
    except ValueError as e:
        raise ValueError(f"{where}: format {fmt!r}: {e}") from None


def render_figures(root: Path, text: str, where: str) -> str:
    """`text` with every tied figure rewritten from its JSON."""
    cache: dict[str, object] = {}

    def figure(m: re.Match) -> str:
        name = m["file"]
        here = f"{where}: figure {m['shown']} ({name})"
        if name not in cache:
            path = _locate(root, name)
            if path is None:
                raise ValueError(f"{here}: no such file in {' or '.join(RESULTS_DIRS)}")
            cache[name] = json.loads(path.read_text())
        shown = _format(_value(cache[name], m["path"], here), m["fmt"], here)
        return m.group(0).replace(m["shown"], shown, 1)

    return FIGURE.sub(figure, text)


def malformed_ties(text: str) -> list[str]:
    """The comments naming a results file that tie no figure (a space in the path, no number
    right before): `pqattn report` would otherwise leave them unchecked."""
    tied = {m.start("file") - len("<!-- ") for m in FIGURE.finditer(text)}
    return [m.group(0) for m in TIE.finditer(text) if m.start() not in tied]


def missing_citations(root: Path, text: str) -> list[str]:
    """The files `text` cites that do not exist (wildcard and brace patterns are not citations)."""
    missing = []
    for m in CITATION.finditer(text):
        if m["path"]:
            path = m["path"]
            ok = (root / path).exists() or (root / "src" / path).exists()
        else:
            path = m["name"]
            ok = _locate(root, path) is not None
        if not ok:
            missing.append(path)
    return sorted(set(missing))


def update_notes(root: str | Path, *, check: bool) -> tuple[bool, list[str]]:
    """Rewrite (or, with check, compare) every note's tied figures; returns whether all were
    current and the problems found (a cited file missing), one line each."""
    root = Path(root)
    current, problems = True, []
    for path in note_files(root):
        if not path.is_file():
            continue
        text = path.read_text()
        where = str(path.relative_to(root))
        new = render_figures(root, text, where)
        if new != text:
            current = False
            if not check:
                path.write_text(new)
        problems += [f"{where} cites {p}, which does not exist" for p in missing_citations(root, text)]
        problems += [
            f"{where}: {tie} ties no figure (NUMBER<!-- FILE.json PATH FORMAT -->, no space in PATH)"
            for tie in malformed_ties(text)
        ]
    return current, problems
