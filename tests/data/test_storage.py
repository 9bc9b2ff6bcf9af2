"""H5Storage / JsonStorage: round trips, lazy global slicing, and clear errors on bad files."""

from __future__ import annotations

import json
import pickle
from pathlib import Path

import h5py
import numpy as np
import pytest
import torch
from data_helpers import write_lines
from torch.utils.data import DataLoader, Dataset

from astrai.data.storage import (
    DataError,
    FingerprintMismatchError,
    H5Storage,
    H5Writer,
    JsonStorage,
    open_storage,
    token_dtype,
)


def _docs(n: int, seed: int = 0, vocab: int = 70_000) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab, size=int(rng.integers(0, 50))) for _ in range(n)]


def _write(path: Path, docs: list[np.ndarray], **attrs) -> Path:
    dtype = token_dtype(int(max((d.max() for d in docs if d.size), default=0)) + 1)
    with H5Writer(
        path,
        dtypes={"input_ids": dtype, "loss_mask": np.uint8},
        attrs={"kind": "sft", "tokenizer_fingerprint": "fp-a", **attrs},
        flush_tokens=100,  # several flushes, exercising the resizable datasets
    ) as w:
        for d in docs:
            w.add(input_ids=d, loss_mask=d % 2)
    return path


def test_h5_round_trip_over_shards(tmp_path: Path) -> None:
    docs = _docs(40)
    _write(tmp_path / "shards" / "a-0.h5", docs[:15])
    _write(tmp_path / "shards" / "a-1.h5", docs[15:])
    st = H5Storage(tmp_path / "shards", keys=["input_ids"], tokenizer_fingerprint="fp-a")
    assert len(st) == 40
    assert st.kind == "sft" and st.tokenizer_fingerprint == "fp-a"
    flat = np.concatenate(docs)
    assert st.num_tokens("input_ids") == flat.size
    for i, d in enumerate(docs):
        np.testing.assert_array_equal(st.get("input_ids", i), d)
        np.testing.assert_array_equal(st.get("loss_mask", i), d % 2)
    np.testing.assert_array_equal(st.get("input_ids", -1), docs[-1])
    # global slices, across document and shard boundaries
    for start, stop in [(0, flat.size), (3, 400), (flat.size - 7, flat.size), (10, 10)]:
        np.testing.assert_array_equal(st.slice("input_ids", start, stop), flat[start:stop])
    np.testing.assert_array_equal(
        st.offsets("input_ids"), np.concatenate([[0], np.cumsum([d.size for d in docs])])
    )
    # cached offsets give the same documents
    np.testing.assert_array_equal(st.get("input_ids", 20), docs[20])
    with pytest.raises(IndexError):
        st.get("input_ids", 40)
    with pytest.raises(IndexError):
        st.slice("input_ids", 0, flat.size + 1)


def test_h5_uses_uint16_for_small_vocabularies(tmp_path: Path) -> None:
    _write(tmp_path / "a.h5", _docs(5, vocab=1000))
    with h5py.File(tmp_path / "a.h5") as f:
        assert f["input_ids"].dtype == np.uint16
        assert f.attrs["format_version"] == 1
    with (
        pytest.raises(ValueError, match="outside uint16"),
        H5Writer(tmp_path / "b.h5", dtypes={"input_ids": np.uint16}) as w,
    ):
        w.add(input_ids=[70_000])
    assert not (tmp_path / "b.h5").exists() and not (tmp_path / "b.h5.tmp").exists()


def test_h5_writer_leaves_nothing_on_error(tmp_path: Path) -> None:
    path = tmp_path / "x.h5"
    with pytest.raises(RuntimeError), H5Writer(path, dtypes={"input_ids": np.uint16}) as w:
        w.add(input_ids=[1, 2, 3])
        raise RuntimeError("interrupted")
    assert list(tmp_path.iterdir()) == []


def test_h5_truncated_file_is_a_clear_error(tmp_path: Path) -> None:
    path = _write(tmp_path / "a.h5", _docs(200))
    data = path.read_bytes()
    bad = tmp_path / "bad.h5"
    bad.write_bytes(data[: len(data) // 2])
    with pytest.raises(DataError, match=r"bad\.h5.*truncated"):
        H5Storage(bad)
    with pytest.raises(FileNotFoundError, match=r"missing\.h5"):
        H5Storage(tmp_path / "missing.h5")


def test_h5_missing_key_and_corrupt_offsets(tmp_path: Path) -> None:
    path = _write(tmp_path / "a.h5", _docs(10))
    with pytest.raises(DataError, match=r"a\.h5: no key 'chosen_ids'"):
        H5Storage(path, keys=["chosen_ids"])
    with h5py.File(path, "r+") as f:  # a file that claims more tokens than it holds
        f["offsets/input_ids"][-1] += 5
    with pytest.raises(DataError, match="corrupt or was truncated"):
        H5Storage(path)
    with h5py.File(path, "r+") as f:
        f["offsets/input_ids"][-1] -= 5
        del f["loss_mask"]
    with pytest.raises(DataError, match="'loss_mask' listed in attrs but missing"):
        H5Storage(path)


def test_h5_not_written_by_astrai(tmp_path: Path) -> None:
    with h5py.File(tmp_path / "foreign.h5", "w") as f:
        f["input_ids"] = np.arange(3)
    with pytest.raises(DataError, match="format_version"):
        H5Storage(tmp_path / "foreign.h5")


def test_fingerprint_mismatch_names_the_file(tmp_path: Path) -> None:
    path = _write(tmp_path / "a.h5", _docs(3))
    H5Storage(path, tokenizer_fingerprint="fp-a")
    with pytest.raises(FingerprintMismatchError, match=r"a\.h5 was built with tokenizer"):
        H5Storage(path, tokenizer_fingerprint="fp-b")


def test_shards_of_different_runs_are_refused(tmp_path: Path) -> None:
    _write(tmp_path / "d" / "a.h5", _docs(3))
    _write(tmp_path / "d" / "b.h5", _docs(3), tokenizer_fingerprint="fp-other")
    with pytest.raises(DataError, match="tokenizer_fingerprint"):
        H5Storage(tmp_path / "d")


class _DocDataset(Dataset):
    def __init__(self, storage: H5Storage) -> None:
        self.storage = storage

    def __len__(self) -> int:
        return len(self.storage)

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.from_numpy(self.storage.get("input_ids", i)).sum()


def test_h5_storage_pickles_and_works_in_worker_processes(tmp_path: Path) -> None:
    docs = _docs(30)
    st = H5Storage(_write(tmp_path / "a.h5", docs))
    st.get("input_ids", 0)  # open a handle in the parent before workers start
    clone = pickle.loads(pickle.dumps(st))
    np.testing.assert_array_equal(clone.get("input_ids", 3), docs[3])
    loader = DataLoader(_DocDataset(st), batch_size=4, num_workers=2)
    sums = torch.cat([b for b in loader])
    assert sums.tolist() == [int(d.sum()) for d in docs]


# ----------------------------------------------------------------------------------- JSON(L)


def test_jsonl_round_trip_tokens_and_text(tmp_path: Path) -> None:
    docs = [d.tolist() for d in _docs(25)]
    path = write_lines(
        tmp_path / "ids.jsonl", [{"input_ids": d, "text": "é" * len(d)} for d in docs]
    )
    st = JsonStorage(path)
    assert len(st) == 25
    assert st.keys == ["input_ids"] and st.string_keys == ["text"]
    for i, d in enumerate(docs):
        assert st.get("input_ids", i).tolist() == d
        assert st.get("text", i) == "é" * len(d)
    flat = np.concatenate([np.asarray(d, dtype=np.int64) for d in docs])
    np.testing.assert_array_equal(st.slice("input_ids", 5, flat.size - 3), flat[5:-3])


def test_json_array_round_trip_with_large_records(tmp_path: Path) -> None:
    # records larger than the 1 MiB scan block, unicode, and a bare list / string
    big = {"input_ids": list(range(300_000)), "text": "ü" * 10}
    values = [{"input_ids": [1, 2, 3], "text": 'a,]}"['}, big, [7, 8], "raw text"]
    path = tmp_path / "a.json"
    path.write_text(json.dumps(values, indent=1, ensure_ascii=False), encoding="utf-8")
    st = JsonStorage(path)
    assert len(st) == 4
    assert [st.record(i) for i in range(4)] == values
    assert st.get("input_ids", 1).tolist() == big["input_ids"]
    assert st.get("input_ids", 2).tolist() == [7, 8]
    assert st.get("text", 3) == "raw text"
    (tmp_path / "empty.json").write_text("[ ]")
    assert len(JsonStorage(tmp_path / "empty.json")) == 0


def test_json_array_errors(tmp_path: Path) -> None:
    (tmp_path / "obj.json").write_text('{"a": 1}')
    with pytest.raises(DataError, match=r"obj\.json: expected a JSON array"):
        len(JsonStorage(tmp_path / "obj.json"))
    (tmp_path / "bad.json").write_text('[{"a": 1}, {"a": ]')
    with pytest.raises(DataError, match=r"bad\.json: element 2: not valid JSON"):
        len(JsonStorage(tmp_path / "bad.json"))


def test_jsonl_bad_line_names_file_and_line(tmp_path: Path) -> None:
    path = write_lines(tmp_path / "d.jsonl", [{"input_ids": [1]}, "", '{"input_ids": [2', {"x": 1}])
    with pytest.raises(DataError, match=r"d\.jsonl:3: not valid JSON"):
        len(JsonStorage(path))
    st = JsonStorage(path, skip_bad_lines=True)
    assert len(st) == 2 and st.bad_lines == 1
    assert st.line_of(1) == 4
    with pytest.raises(
        DataError, match=r"d\.jsonl:4: record is missing required field 'input_ids'"
    ):
        st.get("input_ids", 1)


def test_jsonl_text_is_not_token_ids(tmp_path: Path) -> None:
    st = JsonStorage(write_lines(tmp_path / "t.jsonl", [{"text": "hello"}]))
    with pytest.raises(DataError, match="holds str, not token ids"):
        st.slice("text", 0, 1)


def test_open_storage_dispatches_on_suffix(tmp_path: Path) -> None:
    assert isinstance(open_storage(_write(tmp_path / "a.h5", _docs(2))), H5Storage)
    assert isinstance(open_storage(write_lines(tmp_path / "a.jsonl", [[1, 2]])), JsonStorage)
    with pytest.raises(FileNotFoundError):
        open_storage(tmp_path / "nope.h5")
    _write(tmp_path / "s-1.h5", _docs(3))
    assert len(open_storage(str(tmp_path / "s-*.h5"))) == 3
