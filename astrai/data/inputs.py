"""Where ``prepare`` reads from: files (JSON / JSONL, text, parquet, arrow), directories,
``datasets`` folders or ``builtin:<name>`` records, what the output's signature records about
them, and the tokenizer given as an object or a directory."""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from astrai.data.builtin import BUILTIN_PREFIX, builtin_records
from astrai.data.readers import (
    COLUMNAR_SUFFIXES,
    dataset_folder_files,
    is_dataset_folder,
    iter_columnar,
)
from astrai.data.storage import DataError, JsonStorage
from astrai.tokenizer import AutoTokenizer

TEXT_SUFFIXES = (".txt", ".md")
RECORD_SUFFIXES = (".json", ".jsonl", *COLUMNAR_SUFFIXES)


def input_files(path: Path, kind: str) -> list[Path]:
    """The input files of a file or directory (sorted, hidden ones skipped) for ``kind``; a
    ``datasets`` folder (``save_to_disk``), also inside a directory, is its arrow files in
    the dataset's order."""
    suffixes = RECORD_SUFFIXES + (TEXT_SUFFIXES if kind == "pretrain" else ())
    if path.is_file():
        if path.suffix not in suffixes:
            raise DataError(f"{path}: kind={kind} reads {', '.join(suffixes)} files")
        return [path]
    if is_dataset_folder(path):
        return dataset_folder_files(path)
    if path.is_dir():
        files = _folder_files(path, suffixes)
        if not files:
            raise DataError(f"{path}: no input files ({', '.join(suffixes)}) in this directory")
        return files
    raise FileNotFoundError(f"input not found: {path}")


def _folder_files(path: Path, suffixes: tuple[str, ...]) -> list[Path]:
    """The input files under a directory in path order, a ``datasets`` folder met on the way
    taking the place of its first data file with all of them (its JSON metadata is not
    records)."""

    def visible(p: Path) -> bool:
        return not any(part.startswith(".") for part in p.relative_to(path).parts)

    found = [p for p in path.rglob("*") if visible(p)]
    folders = [p for p in found if is_dataset_folder(p)]
    groups = [(files[0], files) for files in map(dataset_folder_files, folders) if files]
    groups += [
        (p, [p])
        for p in found
        if p.is_file() and p.suffix in suffixes and not any(d in p.parents for d in folders)
    ]
    return [f for _, files in sorted(groups, key=lambda g: g[0]) for f in files]


def is_record_source(input: Any) -> bool:
    """Whether ``input`` makes its records in code (:class:`astrai.data.onpolicy.RecordSource`:
    ``records()`` and ``identity()``) instead of naming files or ``builtin:`` data."""
    return callable(getattr(input, "records", None)) and callable(getattr(input, "identity", None))


def iter_input(input: Any, kind: str, builtin: Mapping[str, Any]) -> Iterator[tuple[str, Any]]:
    """Yield ``(where, record)`` in input order; ``where`` is ``file:line`` for messages.

    A JSONL line that is not JSON comes as a :class:`DataError` record, so that the caller
    raises it or counts it in the shard it belongs to.
    """
    if is_record_source(input):
        for i, record in enumerate(input.records(), start=1):
            yield f"{input!r}#{i}", record
        return
    if input.startswith(BUILTIN_PREFIX):
        name = input[len(BUILTIN_PREFIX) :]
        for i, record in enumerate(builtin_records(name, **dict(builtin)), start=1):
            yield f"{input}#{i}", record
        return
    for path in input_files(Path(input), kind):
        if path.suffix in TEXT_SUFFIXES:
            yield str(path), {"text": path.read_text(encoding="utf-8", errors="replace")}
            continue
        if path.suffix in COLUMNAR_SUFFIXES:
            yield from iter_columnar(path)
            continue
        for line, record in JsonStorage(path).iter_records(with_errors=True):
            yield f"{path}:{line}", record


def input_identity(input: Any, builtin: Mapping[str, Any], kind: str) -> Any:
    """What the signature records about the input: names, sizes and mtimes of the files (a
    record source's own ``identity()``)."""
    if is_record_source(input):
        return input.identity()
    if input.startswith(BUILTIN_PREFIX):
        return {"builtin": input, "options": dict(builtin)}
    files = input_files(Path(input), kind)
    return [(str(p.resolve()), p.stat().st_size, p.stat().st_mtime_ns) for p in files]


def load_tokenizer(tokenizer: Any) -> Any:
    """An ``AutoTokenizer`` from its directory; a tokenizer object is returned as is."""
    if isinstance(tokenizer, str | os.PathLike):
        path = Path(tokenizer)
        if not path.is_dir():
            raise FileNotFoundError(f"tokenizer directory not found: {path}")
        return AutoTokenizer.from_pretrained(str(path))
    return tokenizer


def default_name(input: Any) -> str:
    """The output name when none is given: the input's stem (``builtin:a/b`` -> ``a-b``)."""
    if is_record_source(input):
        return type(input).__name__.lower()
    if input.startswith(BUILTIN_PREFIX):
        return input[len(BUILTIN_PREFIX) :].strip("/").replace("/", "-")
    p = Path(input)
    return p.stem if p.is_file() else p.resolve().name
