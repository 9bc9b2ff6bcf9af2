"""Columnar inputs of ``prepare``: parquet files, arrow IPC files and ``datasets`` folders.

Most public post-training sets are parquet (the Hub's format) or folders that
``datasets.Dataset.save_to_disk`` wrote (arrow IPC streams plus ``state.json``). They are
read one record batch at a time (``pyarrow.parquet.ParquetFile.iter_batches`` through a small
read buffer, an IPC reader over the file), so memory stays bounded by a batch whatever the file's size, and each row
comes as the same Python ``dict`` a JSONL line would give (nested lists and structs
included), with ``file:row N`` (1-based) as its place for messages.

A null is an absent field: arrow gives every row of a file one schema, so a field that some
records lack (a message's ``tool_calls``, a record's ``tools``) is null in the others, and
reading it back as ``None`` would make a chat template see a field the JSONL record never
had. Nulls are dropped from every object, at any depth (list items stay as they are).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from astrai.data.storage import DataError

__all__ = [
    "COLUMNAR_SUFFIXES",
    "DATASET_INFO",
    "dataset_folder_files",
    "is_dataset_folder",
    "iter_columnar",
]

COLUMNAR_SUFFIXES = (".parquet", ".arrow")
#: the files that make a folder a ``save_to_disk`` dataset (``datasets``' own names)
DATASET_INFO, DATASET_STATE, DATASET_DICT = "dataset_info.json", "state.json", "dataset_dict.json"
#: rows per record batch read from a parquet file: a few MB of chat records at most
BATCH_ROWS = 1024
#: a parquet file is read through a buffer of this size, not pre-buffered whole: pyarrow's
#: default (``pre_buffer=True``) holds every column chunk it has read, so a 194 MiB file grew
#: the resident set by 209 MiB; buffered, by 11-13 MiB (tests/data/test_readers.py measures it)
READ_BUFFER = 1 << 20


def is_dataset_folder(path: Path) -> bool:
    """Whether ``path`` is a folder ``Dataset.save_to_disk`` (or ``DatasetDict``'s) wrote."""
    return path.is_dir() and ((path / DATASET_STATE).is_file() or (path / DATASET_DICT).is_file())


def dataset_folder_files(path: Path) -> list[Path]:
    """The arrow files of a ``save_to_disk`` folder, in the dataset's row order
    (``state.json``'s ``_data_files``). A ``DatasetDict`` folder is refused naming its splits:
    the split is chosen by its subfolder (``path/train``)."""
    if (path / DATASET_DICT).is_file():
        splits = _read_json(path / DATASET_DICT).get("splits", [])
        raise DataError(
            f"{path}: a DatasetDict folder (splits {splits}); give one split's folder, "
            f"e.g. {path / (splits[0] if splits else 'train')}"
        )
    state = _read_json(path / DATASET_STATE)
    files = state.get("_data_files")
    if not isinstance(files, list) or not all(
        isinstance(f, dict) and "filename" in f for f in files
    ):
        raise DataError(f"{path / DATASET_STATE}: no '_data_files' list of {{'filename': ...}}")
    out = [path / f["filename"] for f in files]
    missing = [str(p) for p in out if not p.is_file()]
    if missing:
        raise DataError(f"{path}: data files named in {DATASET_STATE} are missing: {missing}")
    if state.get("_indices_data_files"):
        raise DataError(
            f"{path}: a dataset saved with an indices mapping (select/shuffle without "
            f"flatten_indices()); save it after .flatten_indices() so its rows are in its files"
        )
    return out


def iter_columnar(path: Path) -> Iterator[tuple[str, Any]]:
    """``(where, record)`` for every row of a parquet or arrow IPC file, in file order."""
    batches = _parquet_batches(path) if path.suffix == ".parquet" else _arrow_batches(path)
    row = 0
    for batch in batches:
        for record in batch.to_pylist():
            row += 1
            yield f"{path}:row {row}", _without_nulls(record)


def _parquet_batches(path: Path) -> Iterator[Any]:
    import pyarrow.parquet as pq

    try:
        reader = pq.ParquetFile(path, pre_buffer=False, buffer_size=READ_BUFFER)
    except Exception as exc:  # pyarrow raises ArrowInvalid / OSError for a damaged file
        raise DataError(f"{path}: not a readable parquet file: {exc}") from exc
    with reader:
        yield from reader.iter_batches(batch_size=BATCH_ROWS, use_threads=False)


def _arrow_batches(path: Path) -> Iterator[Any]:
    """Record batches of an arrow IPC file in either layout: the random-access file format
    (``pyarrow.ipc.new_file``) or the stream format (what ``datasets`` writes), read from the
    file a batch at a time (not memory-mapped: mapped pages would stay resident)."""
    import pyarrow as pa
    import pyarrow.ipc as ipc

    with pa.OSFile(str(path)) as source:
        try:
            reader = ipc.open_file(source)
        except pa.ArrowInvalid:
            source.seek(0)
            try:
                stream = ipc.open_stream(source)
            except pa.ArrowInvalid as exc:
                raise DataError(f"{path}: not an arrow IPC file or stream: {exc}") from exc
            yield from stream
            return
        for i in range(reader.num_record_batches):
            yield reader.get_batch(i)


def _without_nulls(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _without_nulls(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_without_nulls(v) for v in value]
    return value


def _read_json(path: Path) -> dict[str, Any]:
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise DataError(f"{path}: cannot read: {exc}") from exc
    if not isinstance(value, dict):
        raise DataError(f"{path}: expected a JSON object")
    return value
