"""Plain ``.json`` / ``.jsonl`` records read as a storage, and the atomic JSONL writer."""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from astrai.data.storage.base import JSON_SUFFIXES, DataError, Storage, read_range

log = logging.getLogger(__name__)


class JsonStorage(Storage):
    """Records from a ``.jsonl`` file (one JSON value per line) or a ``.json`` array.

    A record is an object (``{"text": ...}``, ``{"input_ids": [...]}``, ``{"messages": ...}``),
    a bare string (read as key ``text``) or a bare list of ids (key ``input_ids``). On first
    random access the file is scanned once to record the byte offset of every record; records
    are then read by seeking, so memory grows with the number of records, not their size.
    ``iter_records()`` streams without building the index.
    """

    def __init__(
        self,
        path: str | os.PathLike,
        *,
        keys: Sequence[str] = (),
        skip_bad_lines: bool = False,
        tokenizer_fingerprint: Any = None,
    ) -> None:
        self.path = str(path)
        if not os.path.isfile(self.path):
            raise FileNotFoundError(f"storage file not found: {self.path}")
        if Path(self.path).suffix not in JSON_SUFFIXES:
            raise DataError(f"{self.path}: expected a .json or .jsonl file")
        self.skip_bad_lines = skip_bad_lines
        self.bad_lines = 0
        self._spans: np.ndarray | None = None  # [n, 3]: byte start, byte end, line number
        self._offsets: dict[str, np.ndarray] = {}
        self._required = list(keys)
        self.check_fingerprint(tokenizer_fingerprint)

    @property
    def is_jsonl(self) -> bool:
        return self.path.endswith(".jsonl")

    # -- streaming --------------------------------------------------------------------------
    def iter_records(self, with_errors: bool = False) -> Iterator[tuple[int, Any]]:
        """Yield ``(line_number, record)`` in file order (for ``.json``: element number).

        A line that is not JSON raises :class:`DataError` naming file and line, or with
        ``skip_bad_lines`` is skipped and counted in ``bad_lines``; with ``with_errors`` it is
        yielded as ``(line_number, DataError)`` instead, for callers that count it themselves.
        """
        for _, _, line, record in self._scan(with_errors):
            yield line, record

    def _scan(self, with_errors: bool = False) -> Iterator[tuple[int, int, int, Any]]:
        if self.is_jsonl:
            yield from self._scan_jsonl(with_errors)
        else:
            yield from self._scan_json_array()

    def _scan_jsonl(self, with_errors: bool = False) -> Iterator[tuple[int, int, int, Any]]:
        self.bad_lines = 0
        with open(self.path, "rb") as fh:
            pos = 0
            for lineno, raw in enumerate(fh, start=1):
                start, pos = pos, pos + len(raw)
                if not raw.strip():
                    continue
                try:
                    record = json.loads(raw)
                except (json.JSONDecodeError, UnicodeDecodeError) as exc:
                    msg = f"{self.path}:{lineno}: not valid JSON ({_json_reason(exc)})"
                    if with_errors:
                        yield start, pos, lineno, DataError(msg)
                        continue
                    if not self.skip_bad_lines:
                        raise DataError(
                            msg + "; pass skip_bad_lines=true to skip such lines"
                        ) from None
                    self.bad_lines += 1
                    log.warning("skipping %s", msg)
                    continue
                yield start, pos, lineno, record

    def _scan_json_array(self) -> Iterator[tuple[int, int, int, Any]]:
        # Latin-1 maps bytes 1:1 to characters, so decoder positions are byte offsets; values
        # found here are only used to validate, records are re-read as UTF-8 on access.
        decoder = json.JSONDecoder()
        block = 1 << 20
        with open(self.path, "rb") as fh:
            buf = fh.read(block).decode("latin-1")
            base, i, eof = 0, 0, len(buf) < block

            def more() -> bool:
                nonlocal buf, eof
                if eof:
                    return False
                chunk = fh.read(max(block, len(buf)))
                eof = len(chunk) == 0
                buf += chunk.decode("latin-1")
                return not eof

            def skip_ws() -> None:
                nonlocal i
                while True:
                    while i < len(buf) and buf[i] in " \t\r\n":
                        i += 1
                    if i < len(buf) or not more():
                        return

            skip_ws()
            if i >= len(buf):
                raise DataError(f"{self.path}: empty file, expected a JSON array")
            if buf[i] != "[":
                raise DataError(f"{self.path}: expected a JSON array of records at the top level")
            i += 1
            element = 0
            skip_ws()
            if i < len(buf) and buf[i] == "]":
                return
            while True:
                element += 1
                skip_ws()
                while True:
                    try:
                        _, end = decoder.raw_decode(buf, i)
                    except json.JSONDecodeError as exc:
                        if more():
                            continue
                        raise DataError(
                            f"{self.path}: element {element}: not valid JSON ({_json_reason(exc)})"
                        ) from None
                    # a value ending exactly at the buffer end may be cut (e.g. a number)
                    if end < len(buf) or not more():
                        break
                start, stop = base + i, base + end
                raw = buf[i:end].encode("latin-1")
                try:
                    record = json.loads(raw)
                except UnicodeDecodeError as exc:
                    raise DataError(f"{self.path}: element {element}: {exc}") from None
                yield start, stop, element, record
                i = end
                skip_ws()
                if i >= len(buf):
                    raise DataError(f"{self.path}: unterminated JSON array")
                if buf[i] == "]":
                    return
                if buf[i] != ",":
                    raise DataError(f"{self.path}: element {element}: expected ',' or ']' after it")
                i += 1
                # drop consumed text so memory stays bounded by the largest record
                if i > block:
                    base += i
                    buf = buf[i:]
                    i = 0

    # -- index ------------------------------------------------------------------------------
    def _index(self) -> np.ndarray:
        if self._spans is None:
            spans = [(s, e, line) for s, e, line, _ in self._scan()]
            self._spans = np.asarray(spans, dtype=np.int64).reshape(-1, 3)
            if self._required and len(self._spans):
                first = self.record(0)
                for key in self._required:
                    _field(first, key, self.path, int(self._spans[0, 2]))
        return self._spans

    def __len__(self) -> int:
        return len(self._index())

    @property
    def keys(self) -> list[str]:
        if len(self) == 0:
            return []
        rec = self.record(0)
        if isinstance(rec, dict):
            return [k for k, v in rec.items() if _is_id_list(v)]
        return ["input_ids"] if _is_id_list(rec) else []

    @property
    def string_keys(self) -> list[str]:
        if len(self) == 0:
            return []
        rec = self.record(0)
        if isinstance(rec, dict):
            return [k for k, v in rec.items() if not _is_id_list(v)]
        return ["text"] if isinstance(rec, str) else []

    def record(self, index: int) -> Any:
        """The parsed JSON value of record ``index``."""
        spans = self._index()
        if index < 0:
            index += len(spans)
        if not 0 <= index < len(spans):
            raise IndexError(f"{self.path}: record {index} out of range ({len(spans)} records)")
        start, stop, _ = spans[index]
        with open(self.path, "rb") as fh:
            fh.seek(int(start))
            return json.loads(fh.read(int(stop - start)))

    def line_of(self, index: int) -> int:
        """Line number (``.jsonl``) or element number (``.json``) of record ``index``."""
        return int(self._index()[index, 2])

    def get(self, key: str, index: int) -> Any:
        value = _field(self.record(index), key, self.path, self.line_of(index))
        if _is_id_list(value):
            return np.asarray(value, dtype=np.int64)
        return value

    def offsets(self, key: str) -> np.ndarray:
        if key not in self._offsets:
            lengths = np.zeros(len(self) + 1, dtype=np.int64)
            for i, (_, _, line, record) in enumerate(self._scan()):
                value = _field(record, key, self.path, line)
                if not _is_id_list(value):
                    raise DataError(
                        f"{self.path}:{line}: key {key!r} holds {type(value).__name__}, not token "
                        f"ids; tokenize it with `python -m astrai.data.prepare`"
                    )
                lengths[i + 1] = len(value)
            self._offsets[key] = np.cumsum(lengths)
        return self._offsets[key]

    def slice(self, key: str, start: int, stop: int) -> np.ndarray:
        return read_range(
            str(self.path),
            self.offsets(key),
            start,
            stop,
            lambda doc, lo, hi: self.get(key, doc)[lo:hi],
        )


def _is_id_list(value: Any) -> bool:
    return isinstance(value, list) and all(
        isinstance(v, int) and not isinstance(v, bool) for v in value
    )


def _field(record: Any, key: str, path: str, line: int) -> Any:
    if isinstance(record, dict):
        if key not in record:
            raise DataError(
                f"{path}:{line}: record is missing required field {key!r} (has: {sorted(record)})"
            )
        return record[key]
    if key == "text" and isinstance(record, str):
        return record
    if key == "input_ids" and _is_id_list(record):
        return record
    raise DataError(f"{path}:{line}: record is a {type(record).__name__}, has no field {key!r}")


def _json_reason(exc: Exception) -> str:
    if isinstance(exc, json.JSONDecodeError):
        return f"{exc.msg} at column {exc.colno}"
    return str(exc)


def write_jsonl(records: Any, path: str | os.PathLike) -> int:
    """Write records as JSONL atomically (``.tmp`` then rename); returns the count."""
    path = str(path)
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    tmp = path + ".tmp"
    n = 0
    try:
        with open(tmp, "w", encoding="utf-8") as fh:
            for record in records:
                fh.write(json.dumps(record, ensure_ascii=False) + "\n")
                n += 1
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise
    return n
