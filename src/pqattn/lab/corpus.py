"""The text corpus of the project's trained model: the Python sources of the installed packages.

Every machine that runs pqattn has Python packages installed, so their `.py` files are a corpus
that needs no download. The rules, in order:

* roots: the interpreter's site-packages folders (`sysconfig` purelib/platlib and
  `site.getsitepackages()`), each walked recursively; a file is named by its path relative to
  its root, and the files are sorted by that name (files of one package stay together);
* kept: files ending in `.py` of `min_bytes` to `max_bytes` bytes (long files preferred: short
  ones carry little context to learn from, huge ones are mostly generated tables);
* deduplicated by content: the first file (in name order) of each content hash is kept;
* split by content hash: a file is held out when its SHA-1's first 32 bits modulo `holdout_every`
  are 0, so identical copies land on one side and the split does not depend on the machine.

`Corpus.digest` hashes the sorted (name, size, hash) list: two machines share a corpus when they
share the digest. Tokens are bytes (0..255): no tokenizer is needed.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import site
import sysconfig
from collections.abc import Sequence

import torch


@dataclasses.dataclass(frozen=True)
class CorpusSpec:
    min_bytes: int = 8192
    max_bytes: int = 1 << 20
    holdout_every: int = 16


@dataclasses.dataclass(frozen=True)
class SourceFile:
    name: str  # path relative to its site-packages root
    path: str
    size: int
    sha1: str


@dataclasses.dataclass
class Corpus:
    spec: CorpusSpec
    roots: list[str]
    train: list[SourceFile]
    held_out: list[SourceFile]

    @property
    def digest(self) -> str:
        h = hashlib.sha256()
        for f in sorted(self.train + self.held_out, key=lambda f: f.name):
            h.update(f"{f.name}\t{f.size}\t{f.sha1}\n".encode())
        return h.hexdigest()

    def summary(self) -> dict:
        return {
            "spec": dataclasses.asdict(self.spec),
            "roots": self.roots,
            "digest": self.digest,
            "train_files": len(self.train),
            "train_bytes": sum(f.size for f in self.train),
            "held_out_files": len(self.held_out),
            "held_out_bytes": sum(f.size for f in self.held_out),
        }


def site_roots() -> list[str]:
    """The interpreter's site-packages folders that exist, without duplicates, in a fixed order."""
    paths = [sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]]
    if hasattr(site, "getsitepackages"):  # virtualenv's old site module has none
        paths += site.getsitepackages()
    seen, roots = set(), []
    for p in paths:
        real = os.path.realpath(p)
        if os.path.isdir(real) and real not in seen:
            seen.add(real)
            roots.append(real)
    return roots


def _is_held_out(sha1: str, every: int) -> bool:
    return int(sha1[:8], 16) % every == 0


def find_corpus(spec: CorpusSpec = CorpusSpec(), roots: Sequence[str] | None = None) -> Corpus:
    """List, deduplicate and split the source files under `roots` (default: `site_roots()`)."""
    roots = list(site_roots() if roots is None else roots)
    found: dict[str, str] = {}
    for root in roots:
        for folder, dirs, files in os.walk(root):
            dirs.sort()
            for fname in files:
                if not fname.endswith(".py"):
                    continue
                path = os.path.join(folder, fname)
                name = os.path.relpath(path, root)
                if name not in found and os.path.isfile(path):
                    found[name] = path
    seen: set[str] = set()
    train, held = [], []
    for name in sorted(found):
        path = found[name]
        size = os.path.getsize(path)
        if not spec.min_bytes <= size <= spec.max_bytes:
            continue
        with open(path, "rb") as fh:
            sha1 = hashlib.sha1(fh.read()).hexdigest()
        if sha1 in seen:
            continue
        seen.add(sha1)
        f = SourceFile(name, path, size, sha1)
        (held if _is_held_out(sha1, spec.holdout_every) else train).append(f)
    if not train or not held:
        raise ValueError(
            f"roots: expected Python sources of {spec.min_bytes}..{spec.max_bytes} bytes on both sides of "
            f"the split under {roots}, got {len(train)} train and {len(held)} held-out files"
        )
    return Corpus(spec, roots, train, held)


def read_bytes(files: Sequence[SourceFile]) -> torch.Tensor:
    """The files' bytes, concatenated in order, as one uint8 tensor (no separator: a file ends in a
    newline almost always, and the next starts a new module)."""
    chunks = []
    for f in files:
        with open(f.path, "rb") as fh:
            chunks.append(fh.read())
    return torch.frombuffer(bytearray(b"".join(chunks)), dtype=torch.uint8)


def documents(files: Sequence[SourceFile], length: int, count: int) -> list[bytes]:
    """`count` documents of `length` bytes: windows of the files' concatenated bytes (name order)
    whose starts are spread evenly over it, so they start mid-file at arbitrary points, as the
    training windows do, and cover every package; fewer when the files hold fewer disjoint windows."""
    stream = read_bytes(files)
    total = stream.numel()
    count = min(count, total // length)
    if count <= 0:
        return []
    stride = (total - length) // max(1, count - 1) if count > 1 else 0
    return [bytes(stream[i * stride : i * stride + length].numpy()) for i in range(count)]
