"""The training corpus: which files, the split, the digest, and the evaluation windows."""

from __future__ import annotations

import hashlib

import pytest

from pqattn.lab import corpus


def _tree(root, files: dict[str, bytes]) -> None:
    for name, data in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)


def _held(data: bytes, every: int) -> bool:
    return int(hashlib.sha1(data).hexdigest()[:8], 16) % every == 0


def test_files_sizes_duplicates_and_the_split(tmp_path) -> None:
    spec = corpus.CorpusSpec(min_bytes=10, max_bytes=200, holdout_every=3)
    texts = {
        f"pkg{i}/mod{j}.py": f"x_{i}_{j} = {i * j}\n".encode() * (2 + i + j)
        for i in range(4)
        for j in range(5)
    }
    files = dict(texts)
    files["pkg0/tiny.py"] = b"x=1\n"  # under min_bytes
    files["pkg0/huge.py"] = b"y = 2\n" * 100  # over max_bytes
    files["pkg0/notes.txt"] = b"not python\n" * 5
    files["zzz/copy.py"] = texts["pkg1/mod1.py"]  # a duplicate, later in name order
    _tree(tmp_path, files)
    c = corpus.find_corpus(spec, roots=[str(tmp_path)])
    names = [f.name for f in c.train + c.held_out]
    assert sorted(names) == sorted(texts), "sizes, suffix and duplicates filtered"
    assert [f.name for f in c.train] == sorted(f.name for f in c.train)
    for f in c.train + c.held_out:
        assert (f in c.held_out) == _held(texts[f.name], 3)
    assert c.summary()["train_files"] == len(c.train) and len(c.digest) == 64


def test_the_digest_names_the_file_list(tmp_path) -> None:
    spec = corpus.CorpusSpec(min_bytes=1, holdout_every=2)
    files = {f"m{i}.py": f"v{i} = {i}\n".encode() * 3 for i in range(12)}
    _tree(tmp_path / "a", files)
    _tree(tmp_path / "b", files)
    da = corpus.find_corpus(spec, roots=[str(tmp_path / "a")]).digest
    assert da == corpus.find_corpus(spec, roots=[str(tmp_path / "b")]).digest, "same files, same digest"
    (tmp_path / "b" / "m3.py").write_bytes(b"changed = True\n")
    assert corpus.find_corpus(spec, roots=[str(tmp_path / "b")]).digest != da


def test_documents_are_even_windows_of_the_stream(tmp_path) -> None:
    files = {f"m{i:02d}.py": bytes([65 + i]) * 100 for i in range(10)}
    _tree(tmp_path, files)
    c = corpus.find_corpus(corpus.CorpusSpec(min_bytes=1, holdout_every=2), roots=[str(tmp_path)])
    every = sorted(c.train + c.held_out, key=lambda f: f.name)
    stream = b"".join(files[f.name] for f in every)
    docs = corpus.documents(every, 150, 4)
    stride = (len(stream) - 150) // 3
    assert docs == [stream[i * stride : i * stride + 150] for i in range(4)]
    assert len(corpus.documents(every, 300, 100)) == len(stream) // 300
    assert corpus.documents(every, 5000, 3) == []


def test_no_sources_is_an_error(tmp_path) -> None:
    with pytest.raises(ValueError, match="roots"):
        corpus.find_corpus(roots=[str(tmp_path)])
