"""Content fingerprints of storage files (astrai.data.fingerprint): content, not metadata,
computed once per version of a file and cached for later processes."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from pathlib import Path

import numpy as np

from astrai.data.fingerprint import data_changes, dataset_fingerprint, file_digest
from astrai.data.storage import H5Writer

DOCS = [np.arange(i, i + 50 + 7 * i) % 500 for i in range(8)]


def _h5(path: Path, docs: list[np.ndarray], **attrs: object) -> Path:
    with H5Writer(path, dtypes={"input_ids": np.uint16}, attrs=attrs) as w:
        for doc in docs:
            w.add(input_ids=doc)
    return path


def _computed(caplog) -> int:
    return sum("data fingerprint of" in r.getMessage() for r in caplog.records)


def test_digest_follows_the_tokens_not_the_attributes(tmp_path: Path) -> None:
    a = file_digest(_h5(tmp_path / "a.h5", DOCS, signature="run-a", source="/here"))
    same = file_digest(_h5(tmp_path / "b.h5", DOCS, signature="run-b", source="/there"))
    shuffled = file_digest(_h5(tmp_path / "c.h5", DOCS[::-1], signature="run-a"))
    one_token = [d.copy() for d in DOCS]
    one_token[3][10] += 1
    edited = file_digest(_h5(tmp_path / "d.h5", one_token, signature="run-a"))
    assert a == same  # prepared elsewhere, from another path: the same data
    assert len({a, shuffled, edited}) == 3
    assert (tmp_path / "a.h5").stat().st_size == (tmp_path / "c.h5").stat().st_size


def test_jsonl_digest_is_over_its_bytes(tmp_path: Path) -> None:
    path = tmp_path / "d.jsonl"
    path.write_text('{"text": "a"}\n{"text": "b"}\n')
    before = file_digest(path)
    path.write_text('{"text": "b"}\n{"text": "a"}\n')
    assert file_digest(path) != before


def test_computed_once_per_version_and_cached_for_other_processes(tmp_path, caplog) -> None:
    path, cache = _h5(tmp_path / "a.h5", DOCS), tmp_path / "fingerprints"
    with caplog.at_level(logging.INFO, logger="astrai.data.fingerprint"):
        first = file_digest(path, cache)
        assert file_digest(path, cache) == first and file_digest(path) == first
        assert _computed(caplog) == 1
        # another process reads the digest from the cache instead of hashing the file
        code = (
            "import logging, sys; logging.basicConfig(level=logging.INFO); "
            "from astrai.data.fingerprint import file_digest; "
            "print(file_digest(sys.argv[1], sys.argv[2]))"
        )
        other = subprocess.run(
            [sys.executable, "-c", code, str(path), str(cache)],
            capture_output=True,
            text=True,
            check=True,
        )
        assert other.stdout.strip() == first and "data fingerprint of" not in other.stderr
        [entry] = cache.iterdir()
        assert json.loads(entry.read_text())["digest"] == first
        _h5(path, DOCS[::-1])  # rewritten: a new version of the file is hashed again
        assert file_digest(path, cache) != first
        assert _computed(caplog) == 2


def test_dataset_fingerprint_and_changes(tmp_path: Path) -> None:
    class Stored:
        def __init__(self, *paths: Path) -> None:
            self.storage = type("S", (), {"paths": [str(p) for p in paths]})()

    a, b = _h5(tmp_path / "a.h5", DOCS), _h5(tmp_path / "b.h5", DOCS[:4])
    assert dataset_fingerprint(object()) is None  # no storage: nothing to fingerprint
    old = {"train": dataset_fingerprint(Stored(a, b)), "val": None}
    assert [e["file"] for e in old["train"]] == [str(a.resolve()), str(b.resolve())]
    assert data_changes(old, old) == {}
    _h5(b, DOCS[4:8][::-1])
    new = {"train": dataset_fingerprint(Stored(a, b)), "val": None}
    [line] = data_changes(old, new)["train"]
    assert line.startswith(f"{b.resolve()}: ")
    _h5(b, DOCS[:2])
    [line] = data_changes(old, {"train": dataset_fingerprint(Stored(a, b))})["train"]
    assert "bytes" in line and "->" in line  # a different size says so
    [line] = data_changes(old, {"train": dataset_fingerprint(Stored(a))})["train"]
    assert "was 2 files" in line and "now 1 file" in line
