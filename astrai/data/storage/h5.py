"""HDF5 shards: :class:`H5Writer` writes one shard atomically, :class:`H5Storage` reads one or
more shards as one storage (layout in ``astrai.data.storage``).

Every shard carries a checksum of its data, :func:`content_digest` (one BLAKE2b over every
dataset's name, dtype, shape and values; attributes are left out, so storing it changes
nothing it covers), written when the shard is complete. :func:`checked_digest` recomputes
it and names a shard whose bytes changed on disk since (:class:`DamagedDataError`); a
training run does that once per file version, for the data fingerprint it computes anyway
(``astrai.data.fingerprint``). One digest per file rather than per dataset or chunk: a run
reads every dataset to fingerprint it, so per-part sums would add work without catching
more, and HDF5's per-chunk fletcher32 does not cover variable-length strings (``records``).
"""

from __future__ import annotations

import glob
import hashlib
import json
import logging
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import h5py
import numpy as np

from astrai.data.storage.base import (
    FORMAT_VERSION,
    H5_SUFFIXES,
    OFFSETS_GROUP,
    DataError,
    Storage,
    read_range,
)
from astrai.files import publish

log = logging.getLogger(__name__)

#: the attribute holding a shard's :func:`content_digest` (absent in shards written before it)
CHECKSUM_ATTR = "content_digest"
_DIGEST_TAG = b"astrai-h5-v1"  # a new digest never matches an old one
_CHUNK = 1 << 22  # elements per read while hashing a dataset
_UNCHECKED: set[str] = set()  # shards without a checksum, said once per process


class DamagedDataError(DataError):
    """A stored file is cut short or its bytes changed since it was written: prepare it again."""


def content_digest(f: h5py.File) -> str:
    """BLAKE2b-128 of every dataset of an open HDF5 file (name, dtype, shape and values, in
    name order), read in chunks; attributes are not covered."""
    h = hashlib.blake2b(digest_size=16)
    h.update(_DIGEST_TAG)
    names: list[str] = []
    f.visititems(lambda name, obj: names.append(name) if isinstance(obj, h5py.Dataset) else None)
    for name in sorted(names):
        ds = f[name]
        h.update(f"\0{name}|{ds.dtype.str}|{ds.shape}\0".encode())
        if ds.ndim == 0:
            h.update(repr(ds[()]).encode())
            continue
        for start in range(0, ds.shape[0], _CHUNK):
            block = ds[start : start + _CHUNK]
            if block.dtype.kind == "O":  # variable-length strings (records)
                for item in block.ravel():
                    h.update(item if isinstance(item, bytes) else str(item).encode())
                    h.update(b"\0")
            else:
                h.update(np.ascontiguousarray(block).tobytes())
    return h.hexdigest()


def checked_digest(path: str | os.PathLike) -> str:
    """The :func:`content_digest` of the file at ``path``, checked against the checksum stored
    when it was written: a mismatch or a file HDF5 cannot read is a :class:`DamagedDataError`
    naming it. A file without a stored checksum (written by an older astrai) is not checked,
    which is said once per process."""
    path = str(path)
    try:
        with _open_h5(path) as f:
            digest = content_digest(f)
            stored = f.attrs.get(CHECKSUM_ATTR)
    except DamagedDataError:
        raise
    except (OSError, KeyError, ValueError, RuntimeError) as exc:  # HDF5 cannot read a part
        raise DamagedDataError(f"{path}: damaged: cannot read its data ({exc}); {_REDO}") from exc
    if stored is None:
        if path not in _UNCHECKED:
            _UNCHECKED.add(path)
            log.info(
                "%s has no stored checksum (prepared before astrai stored one): its data is "
                "not verified; prepare it again to add one",
                path,
            )
    elif (stored.decode() if isinstance(stored, bytes) else str(stored)) != digest:
        raise DamagedDataError(
            f"{path}: damaged: its data does not match the checksum stored when it was "
            f"written (bytes changed on disk since); {_REDO}"
        )
    return digest


_REDO = (
    "prepare it again (`python -m astrai.data.prepare ... overwrite=true`; for a training "
    "run's prepare: block, remove its folder under <data_dir>/prepared and rerun)"
)


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
        # at interpreter shutdown, module globals (contextlib, h5py) may be gone already
        try:  # noqa: SIM105 - contextlib itself may be None here
            self.close()
        except Exception:
            pass

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
        return _widened(self._read(shard, key, slice(int(start), int(stop))))

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
        return read_range(
            str(self.path),
            self._tok_cum[key],
            start,
            stop,
            lambda shard, lo, hi: self._read(shard, key, slice(lo, hi)),
        )


def _widened(values: np.ndarray) -> np.ndarray:
    """A document as read: ids and masks int64, floats (teacher log-probs) float32."""
    return values.astype(np.float32 if values.dtype.kind == "f" else np.int64)


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
        raise DamagedDataError(
            f"{path}: damaged: cannot open as HDF5 (truncated, still being written, or not "
            f"an astrai storage): {exc}"
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
            if arr.size and self.dtypes[key].kind in "iu":  # ids and masks; floats as given
                info = np.iinfo(self.dtypes[key])
                if arr.min() < info.min or arr.max() > info.max:
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
        f.attrs[CHECKSUM_ATTR] = content_digest(f)  # the data is complete: what it reads back
        f.close()
        self._f = None
        publish(self.tmp_path, self.path)
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
