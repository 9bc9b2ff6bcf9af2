"""Local task files: JSONL (or a JSON array) of records, checked field by field.

Every problem is a :class:`~astrai.data.storage.DataError` that names the file and line
(``tasks.jsonl:7: field 'choices' ...``), raised while a suite is built, so a bad file stops
an evaluation before any model is loaded. Samples that ship with the package live in
``astrai/eval/data/`` and are what a suite reads when it is given no path.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from astrai.data.storage import DataError, JsonStorage

__all__ = ["DATA_DIR", "DataError", "read_records", "resolve_path", "text_field"]

#: Sample task files shipped with the package.
DATA_DIR = Path(__file__).resolve().parent / "data"


def resolve_path(path: str | os.PathLike | None, sample: str) -> Path:
    """`path`, or the shipped sample `astrai/eval/data/<sample>` when `path` is None."""
    resolved = DATA_DIR / sample if path is None else Path(path).expanduser()
    if not resolved.is_file():
        raise FileNotFoundError(f"task file not found: {resolved}")
    return resolved


def read_records(path: str | os.PathLike, limit: int | None = None) -> list[tuple[str, dict]]:
    """`(where, record)` for the first `limit` records of a task file, `where` being
    ``file:line`` for error messages and samples; every record must be a JSON object."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"task file not found: {path}")
    out: list[tuple[str, dict]] = []
    for line, record in JsonStorage(path).iter_records():
        where = f"{path}:{line}"
        if not isinstance(record, dict):
            raise DataError(f"{where}: expected a JSON object, got {type(record).__name__}")
        out.append((where, record))
        if limit is not None and len(out) >= limit:
            break
    if not out:
        raise DataError(f"{path}: no records")
    return out


def text_field(record: dict[str, Any], key: str, where: str) -> str:
    """`record[key]` as a non-empty string, else an error naming `where` and the field."""
    if key not in record:
        raise DataError(f"{where}: missing field {key!r} (has: {sorted(record)})")
    value = record[key]
    if not isinstance(value, str) or not value.strip():
        raise DataError(f"{where}: field {key!r} must be a non-empty string, got {value!r}")
    return value
