"""Content fingerprints of storage files (astrai.data.fingerprint): content, not metadata,
computed once per version of a file and cached for later processes."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import h5py
import numpy as np
import pytest

from astrai.data.fingerprint import data_changes, dataset_fingerprint, file_digest
from astrai.data.storage import H5Storage, H5Writer
from astrai.data.storage.h5 import CHECKSUM_ATTR, DamagedDataError

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


def _zero_tokens(path: Path, start: int = 10, n: int = 32) -> None:
    """Zero `n` tokens' bytes inside the stored `input_ids` (a bad copy, bit rot): the file
    keeps its size and structure and opens as before."""
    with h5py.File(path, "r") as f:
        offset = f["input_ids"].id.get_chunk_info(0).byte_offset
    with open(path, "r+b") as fh:
        fh.seek(offset + 2 * start)
        fh.write(b"\0" * (2 * n))


def test_bytes_zeroed_inside_a_shard_are_caught_by_its_stored_checksum(tmp_path: Path) -> None:
    path = _h5(tmp_path / "a.h5", DOCS)
    good = file_digest(path)
    _zero_tokens(path)
    storage = H5Storage(path)  # still opens: its metadata is whole
    assert len(storage) == len(DOCS) and storage.get("input_ids", 0)[10] == 0
    with pytest.raises(DamagedDataError) as err:
        file_digest(path, tmp_path / "fingerprints")
    message = str(err.value)
    assert message.startswith(f"{path.resolve()}: damaged: its data does not match the checksum")
    assert "overwrite=true" in message and "\n" not in message
    assert not (tmp_path / "fingerprints").exists()  # a damaged file's digest is not kept
    assert file_digest(_h5(path, DOCS)) == good  # prepared again: whole, the same data


def test_a_training_run_names_a_damaged_shard_before_its_first_step(tmp_path: Path) -> None:
    """Opening the data for training (`setup("fit")`) fingerprints it, which verifies it."""
    from astrai.data import AstraiDataModule

    path = _h5(tmp_path / "c.h5", DOCS)
    _zero_tokens(path)
    spec = {"_target_": "astrai.data.PretrainDataset", "source": str(path), "window_size": 8}
    dm = AstraiDataModule(spec, batch_size=2, seed=0)
    with pytest.raises(DamagedDataError, match=rf"{path.resolve()}: damaged"):
        dm.setup("fit")


def test_a_shard_without_a_stored_checksum_is_read_unverified_and_said_once(
    tmp_path: Path, caplog
) -> None:
    """Shards prepared before the checksum existed still train; nothing is verified, which is
    logged once per file and process."""
    path = _h5(tmp_path / "old.h5", DOCS)
    good = file_digest(path)
    with h5py.File(path, "r+") as f:
        del f.attrs[CHECKSUM_ATTR]
    _zero_tokens(path)
    with caplog.at_level(logging.INFO, logger="astrai.data.storage.h5"):
        damaged = file_digest(path)
        _h5(tmp_path / "other.h5", DOCS)
        os.utime(path)  # a new version: computed again, not said again
        assert file_digest(path) == damaged != good
    assert caplog.text.count(f"{path.resolve()} has no stored checksum") == 1


@pytest.mark.slow
def test_the_training_command_stops_on_a_damaged_prepared_shard(tmp_path: Path) -> None:
    """`python -m astrai.train` prepares its data, then a byte-flip inside the prepared shard:
    the next run stops before its first step with one line naming the file."""
    run = [
        sys.executable,
        "-m",
        "astrai.train",
        "model=tiny",
        "tokenizer.train.vocab_size=512",
        "tokenizer.train.max_bytes=400000",
        "data.train.prepare.builtin.max_bytes=100000",
        "data.val.prepare.builtin.max_bytes=20000",
        "trainer.max_steps=2",
        "data.batch_size=4",
        "callbacks.progress_bar=null",
        "trainer.enable_model_summary=false",
        f"paths.data_dir={tmp_path / 'data'}",
        f"paths.log_dir={tmp_path / 'outputs'}",
    ]
    env = {**os.environ, "WANDB_MODE": "offline", "OMP_NUM_THREADS": "1"}
    root = Path(__file__).resolve().parents[2]
    first = subprocess.run(run, cwd=root, env=env, capture_output=True, text=True)
    assert first.returncode == 0, first.stderr[-3000:]
    [shard] = (tmp_path / "data" / "prepared").glob("*/*train*.h5")
    with h5py.File(shard, "r") as f:
        offset = f["input_ids"].id.get_chunk_info(0).byte_offset
    with open(shard, "r+b") as fh:
        fh.seek(offset + 1000)
        fh.write(b"\xff" * 16)
    again = subprocess.run(run, cwd=root, env=env, capture_output=True, text=True)
    assert again.returncode == 1
    line = again.stderr.strip().splitlines()[-1]
    assert line.startswith(
        f"astrai.train: data.train: {shard.resolve()}: damaged: its data does not match the checksum"
    )
    assert line.endswith("remove its folder under <data_dir>/prepared and rerun)")
