"""Token storages: HDF5 shards written by ``prepare`` and plain JSON / JSONL files.

Both storages hold *documents* by *key* (``input_ids``, ``loss_mask``, ...) and read lazily:
opening a storage reads metadata only, ``get(key, i)`` reads one document and
``slice(key, start, stop)`` reads a global token range, so a corpus far larger than memory
can be indexed at random.

HDF5 layout of one shard (``FORMAT_VERSION`` 1)::

    /<key>            1-D token array, all documents concatenated (uint16/uint32, masks uint8)
    /offsets/<key>    int64 [num_documents + 1], document i is <key>[off[i]:off[i + 1]]
    /<string key>     variable-length UTF-8 strings, one per document (e.g. ``records``)
    attrs             format_version, kind, tokenizer_fingerprint, vocab_size, keys,
                      string_keys, num_documents, num_tokens, stats, signature

Several shards (a directory or a list of files) read as one storage, documents in file order.
h5py handles are opened on first access in each process and never pickled, so a storage can be
handed to DataLoader workers (fork or spawn) and DDP ranks.
"""

from __future__ import annotations

import contextlib
import glob
import json
import logging
import os
from abc import ABC, abstractmethod
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import h5py
import numpy as np

log = logging.getLogger(__name__)

FORMAT_VERSION = 1
OFFSETS_GROUP = "offsets"
H5_SUFFIXES = (".h5", ".hdf5")
JSON_SUFFIXES = (".json", ".jsonl")


class DataError(ValueError):
    """Bad or inconsistent data; the message names the file (and line, key or field)."""


class FingerprintMismatchError(DataError):
    """The storage was built with a different tokenizer than the one in use."""


def token_dtype(vocab_size: int) -> np.dtype:
    """Smallest unsigned dtype that holds every id of a vocabulary (halves disk and I/O)."""
    return np.dtype(np.uint16) if vocab_size <= 2**16 else np.dtype(np.uint32)


def fingerprint_of(tokenizer: Any) -> str | None:
    """Fingerprint of a tokenizer object, a fingerprint string, or a tokenizer directory."""
    if tokenizer is None:
        return None
    if isinstance(tokenizer, str | os.PathLike):
        path = Path(tokenizer)
        if not path.is_dir():
            return str(tokenizer)
        from astrai.tokenizer import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(str(path))
    return str(tokenizer.fingerprint)


class Storage(ABC):
    """Documents by key, read lazily; the interface the datasets use."""

    path: str

    @property
    @abstractmethod
    def keys(self) -> list[str]:
        """Keys whose documents are token arrays."""

    @property
    def string_keys(self) -> list[str]:
        """Keys whose documents are strings (raw text, JSON records)."""
        return []

    @property
    def tokenizer_fingerprint(self) -> str | None:
        return None

    @property
    def kind(self) -> str | None:
        return None

    @abstractmethod
    def __len__(self) -> int:
        """Number of documents."""

    @abstractmethod
    def get(self, key: str, index: int) -> Any:
        """Document ``index`` of ``key``: an int64 array for token keys, else the raw value."""

    @abstractmethod
    def offsets(self, key: str) -> np.ndarray:
        """Global document offsets of a token key, int64 [num_documents + 1]."""

    @abstractmethod
    def slice(self, key: str, start: int, stop: int) -> np.ndarray:
        """Tokens ``start:stop`` of the concatenation of all documents of ``key``."""

    def num_tokens(self, key: str) -> int:
        return int(self.offsets(key)[-1])

    def require(self, *keys: str) -> None:
        """Raise a clear error if a key the caller needs is absent."""
        available = set(self.keys) | set(self.string_keys)
        for key in keys:
            if key not in available:
                raise DataError(
                    f"{self.path}: no key {key!r} (available: {sorted(available)}); "
                    f"was it prepared with the right kind?"
                )

    def check_fingerprint(self, expected: Any) -> None:
        """Refuse to read token ids that a different tokenizer produced.

        ``expected`` is a fingerprint, a tokenizer or a tokenizer directory; ``None`` skips the
        check. Storages without a recorded fingerprint (plain JSON) cannot be checked.
        """
        expected_fp = fingerprint_of(expected)
        if expected_fp is None:
            return
        actual = self.tokenizer_fingerprint
        if actual is None:
            log.warning("%s records no tokenizer fingerprint; cannot verify it", self.path)
            return
        if actual != expected_fp:
            raise FingerprintMismatchError(
                f"{self.path} was built with tokenizer fingerprint {actual[:16]}..., but the "
                f"tokenizer in use has {expected_fp[:16]}...; re-run `python -m "
                f"astrai.data.prepare` with this tokenizer or use the one it was built with"
            )


# --------------------------------------------------------------------------------------- HDF5


class H5Storage(Storage):
    """One or more HDF5 shards written by :class:`H5Writer`, read as one storage.

    Only metadata (attributes, per-shard counts) is read at construction; document offsets are
    read on first use and token data chunk by chunk, so memory does not grow with the corpus.
    """

    def __init__(
        self,
        paths: str | os.PathLike | Sequence[str | os.PathLike],
        *,
        keys: Sequence[str] = (),
        tokenizer_fingerprint: Any = None,
    ) -> None:
        self.paths = resolve_h5_paths(paths)
        self.path = self.paths[0] if len(self.paths) == 1 else os.path.dirname(self.paths[0])
        self._files: list[h5py.File | None] = [None] * len(self.paths)
        self._pid = os.getpid()
        self._offsets: dict[str, np.ndarray] = {}
        self._attrs: dict[str, Any] = {}
        self._read_metadata()
        self.require(*keys)
        self.check_fingerprint(tokenizer_fingerprint)

    # -- metadata ---------------------------------------------------------------------------
    def _read_metadata(self) -> None:
        doc_counts: list[int] = []
        token_counts: dict[str, list[int]] = {}
        first_keys: list[str] | None = None
        for path in self.paths:
            with _open_h5(path) as f:
                attrs = _read_attrs(f, path)
                keys = list(attrs["keys"])
                if first_keys is None:
                    first_keys = keys
                    self._attrs = attrs
                    self._string_keys = list(attrs.get("string_keys", []))
                else:
                    for name in ("kind", "tokenizer_fingerprint", "format_version"):
                        if attrs.get(name) != self._attrs.get(name):
                            raise DataError(
                                f"{path}: attribute {name}={attrs.get(name)!r} differs from "
                                f"{self.paths[0]} ({self._attrs.get(name)!r}); shards of one "
                                f"storage must come from one prepare run"
                            )
                    if keys != first_keys:
                        raise DataError(f"{path}: keys {keys} differ from {first_keys}")
                n_docs = int(attrs["num_documents"])
                for key in keys:
                    if key not in f:
                        raise DataError(f"{path}: key {key!r} listed in attrs but missing")
                    off_name = f"{OFFSETS_GROUP}/{key}"
                    if off_name not in f:
                        raise DataError(f"{path}: document offsets {off_name!r} missing")
                    off = f[off_name]
                    if off.shape != (n_docs + 1,):
                        raise DataError(
                            f"{path}: {off_name} has shape {off.shape}, expected ({n_docs + 1},)"
                        )
                    n_tok = int(off[-1]) if n_docs else 0
                    if n_tok != f[key].shape[0]:
                        raise DataError(
                            f"{path}: key {key!r} holds {f[key].shape[0]} tokens but its offsets "
                            f"end at {n_tok}; the file is corrupt or was truncated"
                        )
                    token_counts.setdefault(key, []).append(n_tok)
                for key in self._string_keys:
                    if key not in f or f[key].shape[0] != n_docs:
                        raise DataError(f"{path}: string key {key!r} missing or incomplete")
                doc_counts.append(n_docs)
        self._keys = first_keys or []
        self._doc_cum = np.concatenate([[0], np.cumsum(doc_counts)]).astype(np.int64)
        self._tok_cum = {
            k: np.concatenate([[0], np.cumsum(v)]).astype(np.int64) for k, v in token_counts.items()
        }

    @property
    def attrs(self) -> dict[str, Any]:
        """Attributes of the first shard (format_version, kind, tokenizer_fingerprint, ...)."""
        return dict(self._attrs)

    @property
    def keys(self) -> list[str]:
        return list(self._keys)

    @property
    def string_keys(self) -> list[str]:
        return list(self._string_keys)

    @property
    def tokenizer_fingerprint(self) -> str | None:
        return self._attrs.get("tokenizer_fingerprint") or None

    @property
    def kind(self) -> str | None:
        return self._attrs.get("kind")

    def __len__(self) -> int:
        return int(self._doc_cum[-1])

    def num_tokens(self, key: str) -> int:
        self.require(key)
        return int(self._tok_cum[key][-1])

    # -- lazy handles -----------------------------------------------------------------------
    def _file(self, shard: int) -> h5py.File:
        if self._pid != os.getpid():  # forked: inherited handles must not be used
            self._files = [None] * len(self.paths)
            self._pid = os.getpid()
        f = self._files[shard]
        if f is None:
            f = _open_h5(self.paths[shard])
            self._files[shard] = f
        return f

    def close(self) -> None:
        for f in self._files:
            if f is not None and self._pid == os.getpid():
                f.close()
        self._files = [None] * len(self.paths)

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_files"] = [None] * len(self.paths)
        state["_offsets"] = {}
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._pid = os.getpid()

    def __enter__(self) -> H5Storage:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        with contextlib.suppress(Exception):  # interpreter shutdown
            self.close()

    # -- reading ----------------------------------------------------------------------------
    def _locate_doc(self, index: int) -> tuple[int, int]:
        n = len(self)
        if index < 0:
            index += n
        if not 0 <= index < n:
            raise IndexError(f"{self.path}: document {index} out of range ({n} documents)")
        shard = int(np.searchsorted(self._doc_cum, index, side="right")) - 1
        return shard, index - int(self._doc_cum[shard])

    def _read(self, shard: int, name: str, sel: Any) -> Any:
        try:
            return self._file(shard)[name][sel]
        except (OSError, KeyError, ValueError) as exc:
            raise DataError(f"{self.paths[shard]}: cannot read {name!r}: {exc}") from exc

    def get(self, key: str, index: int) -> Any:
        shard, local = self._locate_doc(index)
        if key in self._string_keys:
            value = self._read(shard, key, local)
            return value.decode("utf-8") if isinstance(value, bytes) else str(value)
        self.require(key)
        if key in self._offsets:  # cached global offsets: no extra read
            g = int(self._doc_cum[shard]) + local
            start, stop = self._offsets[key][g : g + 2] - self._tok_cum[key][shard]
        else:
            start, stop = self._read(shard, f"{OFFSETS_GROUP}/{key}", slice(local, local + 2))
        return self._read(shard, key, slice(int(start), int(stop))).astype(np.int64)

    def offsets(self, key: str) -> np.ndarray:
        """Global document offsets; read once (8 bytes per document, not per token)."""
        self.require(key)
        if key not in self._offsets:
            parts = [np.zeros(1, dtype=np.int64)]
            for shard in range(len(self.paths)):
                off = self._read(shard, f"{OFFSETS_GROUP}/{key}", slice(1, None))
                parts.append(off.astype(np.int64) + self._tok_cum[key][shard])
            self._offsets[key] = np.concatenate(parts)
        return self._offsets[key]

    def slice(self, key: str, start: int, stop: int) -> np.ndarray:
        self.require(key)
        cum = self._tok_cum[key]
        total = int(cum[-1])
        if not 0 <= start <= stop <= total:
            raise IndexError(f"{self.path}: token range {start}:{stop} outside 0:{total}")
        parts = []
        shard = int(np.searchsorted(cum, start, side="right")) - 1
        pos = start
        while pos < stop:
            base, end = int(cum[shard]), int(cum[shard + 1])
            take = min(stop, end)
            if take > pos:
                parts.append(self._read(shard, key, slice(pos - base, take - base)))
            pos = take
            shard += 1
        if not parts:
            return np.zeros(0, dtype=np.int64)
        return np.concatenate(parts).astype(np.int64)


def resolve_h5_paths(paths: str | os.PathLike | Sequence[str | os.PathLike]) -> list[str]:
    """A file, a directory of shards (``*.h5`` sorted by name), a glob, or a list of these."""
    items = [paths] if isinstance(paths, str | os.PathLike) else list(paths)
    out: list[str] = []
    for item in items:
        p = Path(item)
        if not p.exists() and glob.has_magic(str(item)):
            matches = sorted(glob.glob(str(item)))
            if not matches:
                raise FileNotFoundError(f"no storage files match {item}")
            out.extend(matches)
        elif p.is_dir():
            shards = sorted(q for q in p.iterdir() if q.suffix in H5_SUFFIXES and q.is_file())
            if not shards:
                raise DataError(f"{p}: directory holds no .h5 shards")
            out.extend(str(q) for q in shards)
        elif p.exists():
            out.append(str(p))
        else:
            raise FileNotFoundError(f"storage file not found: {p}")
    if not out:
        raise DataError("no storage paths given")
    return out


def _open_h5(path: str) -> h5py.File:
    if not os.path.exists(path):
        raise FileNotFoundError(f"storage file not found: {path}")
    try:
        return h5py.File(path, "r")
    except OSError as exc:
        raise DataError(
            f"{path}: cannot open as HDF5 (truncated, still being written, or not an "
            f"astrai storage): {exc}"
        ) from exc


def _read_attrs(f: h5py.File, path: str) -> dict[str, Any]:
    attrs: dict[str, Any] = {}
    for name, value in f.attrs.items():
        if isinstance(value, bytes):
            value = value.decode("utf-8")
        if isinstance(value, np.generic):
            value = value.item()
        attrs[name] = value
    version = attrs.get("format_version")
    if version is None:
        raise DataError(f"{path}: no 'format_version' attribute; not written by astrai")
    if int(version) > FORMAT_VERSION:
        raise DataError(
            f"{path}: format_version {version} is newer than this astrai reads "
            f"({FORMAT_VERSION}); upgrade astrai"
        )
    for name in ("keys", "string_keys", "stats"):
        if isinstance(attrs.get(name), str):
            attrs[name] = json.loads(attrs[name])
    attrs.setdefault("keys", [])
    if "num_documents" not in attrs:
        raise DataError(f"{path}: no 'num_documents' attribute; incomplete file")
    return attrs


class H5Writer:
    """Append documents to one HDF5 shard; the file appears only when ``close()`` succeeds.

    Data goes to ``<path>.tmp`` and is renamed over ``<path>`` at the end, so an interrupted
    write never leaves a file that looks complete. Use as a context manager: on an exception
    the temporary file is removed.
    """

    def __init__(
        self,
        path: str | os.PathLike,
        *,
        dtypes: dict[str, Any],
        string_keys: Sequence[str] = (),
        attrs: dict[str, Any] | None = None,
        chunk_size: int = 1 << 16,
        flush_tokens: int = 1 << 22,
    ) -> None:
        self.path = str(path)
        self.tmp_path = self.path + ".tmp"
        self.dtypes = {k: np.dtype(v) for k, v in dtypes.items()}
        self.string_keys = list(string_keys)
        self.attrs = dict(attrs or {})
        self.flush_tokens = flush_tokens
        Path(self.path).parent.mkdir(parents=True, exist_ok=True)
        if os.path.exists(self.tmp_path):
            os.remove(self.tmp_path)
        self._f: h5py.File | None = h5py.File(self.tmp_path, "w")
        for key, dtype in self.dtypes.items():
            self._f.create_dataset(
                key, shape=(0,), maxshape=(None,), dtype=dtype, chunks=(chunk_size,)
            )
        for key in self.string_keys:
            self._f.create_dataset(
                key,
                shape=(0,),
                maxshape=(None,),
                dtype=h5py.string_dtype("utf-8"),
                chunks=(1024,),
            )
        self._buffers: dict[str, list[np.ndarray]] = {k: [] for k in self.dtypes}
        self._strings: dict[str, list[str]] = {k: [] for k in self.string_keys}
        self._lengths: dict[str, list[int]] = {k: [] for k in self.dtypes}
        self._buffered = 0
        self.num_documents = 0
        self.num_tokens = 0

    def add(self, **values: Any) -> None:
        """Append one document: one array per token key, one string per string key."""
        expected = set(self.dtypes) | set(self.string_keys)
        if set(values) != expected:
            raise ValueError(f"H5Writer.add expects keys {sorted(expected)}, got {sorted(values)}")
        for key in self.dtypes:
            arr = np.asarray(values[key])
            if arr.ndim != 1:
                raise ValueError(f"{key}: expected a 1-D sequence, got shape {arr.shape}")
            info = np.iinfo(self.dtypes[key])
            if arr.size and (arr.min() < info.min or arr.max() > info.max):
                raise ValueError(f"{key}: values outside {self.dtypes[key]} range")
            self._buffers[key].append(arr.astype(self.dtypes[key], copy=False))
            self._lengths[key].append(arr.size)
            self._buffered += arr.size
        for key in self.string_keys:
            self._strings[key].append(str(values[key]))
        self.num_documents += 1
        first = next(iter(self.dtypes), None)
        if first is not None:
            self.num_tokens += self._lengths[first][-1]
        if self._buffered >= self.flush_tokens:
            self._flush()

    def _flush(self) -> None:
        assert self._f is not None
        for key, chunks in self._buffers.items():
            if not chunks:
                continue
            data = np.concatenate(chunks)
            ds = self._f[key]
            n = ds.shape[0]
            ds.resize((n + data.size,))
            ds[n:] = data
            self._buffers[key] = []
        for key, strings in self._strings.items():
            if not strings:
                continue
            ds = self._f[key]
            n = ds.shape[0]
            ds.resize((n + len(strings),))
            ds[n:] = strings
            self._strings[key] = []
        self._buffered = 0

    def close(self) -> str:
        """Write offsets and attributes, then atomically rename the file into place."""
        if self._f is None:
            return self.path
        self._flush()
        f = self._f
        for key, lengths in self._lengths.items():
            offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
            np.cumsum(np.asarray(lengths, dtype=np.int64), out=offsets[1:])
            f.create_dataset(f"{OFFSETS_GROUP}/{key}", data=offsets)
        attrs = {
            "format_version": FORMAT_VERSION,
            **self.attrs,
            "keys": json.dumps(list(self.dtypes)),
            "string_keys": json.dumps(self.string_keys),
            "num_documents": self.num_documents,
            "num_tokens": self.num_tokens,
        }
        for name, value in attrs.items():
            if isinstance(value, dict | list | tuple):
                value = json.dumps(value)
            if value is None:
                value = ""
            f.attrs[name] = value
        f.close()
        self._f = None
        os.replace(self.tmp_path, self.path)
        return self.path

    def abort(self) -> None:
        """Discard everything written so far."""
        if self._f is not None:
            self._f.close()
            self._f = None
        if os.path.exists(self.tmp_path):
            os.remove(self.tmp_path)

    def __enter__(self) -> H5Writer:
        return self

    def __exit__(self, exc_type: Any, *exc: object) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()


# --------------------------------------------------------------------------------------- JSON


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
        off = self.offsets(key)
        total = int(off[-1])
        if not 0 <= start <= stop <= total:
            raise IndexError(f"{self.path}: token range {start}:{stop} outside 0:{total}")
        parts = []
        doc = int(np.searchsorted(off, start, side="right")) - 1
        pos = start
        while pos < stop:
            base, end = int(off[doc]), int(off[doc + 1])
            take = min(stop, end)
            if take > pos:
                parts.append(self.get(key, doc)[pos - base : take - base])
            pos = take
            doc += 1
        return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)


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


def open_storage(source: Any, **kwargs: Any) -> Storage:
    """A storage from a path (``.h5``, ``.json``, ``.jsonl``, a shard directory) or a list."""
    if isinstance(source, Storage):
        for name in ("keys", "tokenizer_fingerprint"):
            value = kwargs.get(name)
            if name == "keys" and value:
                source.require(*value)
            elif name == "tokenizer_fingerprint" and value is not None:
                source.check_fingerprint(value)
        return source
    if isinstance(source, str | os.PathLike):
        suffix = Path(source).suffix
        if suffix in JSON_SUFFIXES:
            return JsonStorage(source, **kwargs)
        return H5Storage(source, **kwargs)
    if isinstance(source, Sequence):
        return H5Storage([os.fspath(s) for s in source], **kwargs)
    raise TypeError(f"cannot open a storage from {type(source).__name__}: {source!r}")
