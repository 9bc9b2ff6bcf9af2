"""Content fingerprints of the files a dataset reads, so that a resumed run refuses changed data.

A checkpoint's data position (:class:`astrai.data.sampler.ResumableSampler`) is an index into
the training samples; resumed on other data (a re-prepared corpus, a file shuffled into the
same number of windows) it would continue at that index of different samples, silently.
:class:`astrai.data.AstraiDataModule` stores the fingerprint of every split's files in each
checkpoint and compares it on resume (:func:`data_changes`).

The digest covers content, not metadata: for HDF5 every dataset's name, dtype, shape and values
but not the attributes, which record where and from what the data was prepared (the same tokens
prepared on another machine are the same data); for any other file (JSON, JSONL) its bytes.
The HDF5 digest is the checksum ``prepare`` stores in each shard
(:func:`astrai.data.storage.h5.checked_digest`), so computing it also verifies the shard: one
whose bytes changed on disk since it was prepared is named as damaged before training starts.
Hashing reads a file once: the result is kept for the process and, with a ``cache_dir``, on
disk, keyed by the file's path, size, mtime, ctime (which no user-level tool can set back) and
inode, so a run hashes each file at most once and later runs not at all until it changes.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from astrai.data.storage import H5_SUFFIXES
from astrai.data.storage.h5 import checked_digest

log = logging.getLogger(__name__)

__all__ = [
    "DataChangedError",
    "data_changes",
    "dataset_fingerprint",
    "file_digest",
    "storage_files",
]

_VERSION = 1  # of the digest: a new one never matches an old one
_MEMO: dict[tuple[str, int, int, int, int], str] = {}


class DataChangedError(ValueError):
    """A run resumed on data other than the data its checkpoint was trained on."""


def _hasher() -> Any:
    return hashlib.blake2b(digest_size=16)


def _bytes_digest(path: str) -> str:
    h = _hasher()
    h.update(f"astrai-bytes-v{_VERSION}".encode())
    with open(path, "rb") as fh:
        while chunk := fh.read(1 << 24):
            h.update(chunk)
    return h.hexdigest()


def file_digest(path: str | os.PathLike, cache_dir: str | os.PathLike | None = None) -> str:
    """The content digest of one storage file, computed once per version of the file.

    ``cache_dir`` (e.g. ``${paths.data_dir}/fingerprints``) keeps digests across processes;
    an unwritable one is skipped with a debug message.
    """
    real = os.path.realpath(path)
    st = os.stat(real)
    key = (real, st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino)
    if key in _MEMO:
        return _MEMO[key]
    record = {"version": _VERSION, "path": real, "stat": list(key[1:])}
    cached = None
    if cache_dir is not None:
        name = hashlib.sha256(real.encode()).hexdigest()[:24] + ".json"
        cached = Path(cache_dir) / name
        try:
            saved = json.loads(cached.read_text())
            if {k: saved.get(k) for k in record} == record and saved.get("digest"):
                _MEMO[key] = str(saved["digest"])
                return _MEMO[key]
        except (OSError, ValueError):
            pass
    started = time.perf_counter()
    digest = checked_digest(real) if Path(real).suffix in H5_SUFFIXES else _bytes_digest(real)
    log.info(
        "data fingerprint of %s (%.1f MB) computed in %.2f s",
        real,
        st.st_size / 1e6,
        time.perf_counter() - started,
    )
    _MEMO[key] = digest
    if cached is not None:
        try:
            cached.parent.mkdir(parents=True, exist_ok=True)
            tmp = cached.with_name(f".{cached.name}.tmp{os.getpid()}")
            tmp.write_text(json.dumps({**record, "digest": digest}))
            os.replace(tmp, cached)
        except OSError as exc:
            log.debug("cannot cache the data fingerprint in %s: %s", cache_dir, exc)
    return digest


def storage_files(storage: Any) -> list[str]:
    """The files a storage reads: an HDF5 storage's shards, else its one ``path``."""
    paths = getattr(storage, "paths", None)
    if paths:
        return [str(p) for p in paths]
    path = getattr(storage, "path", None)
    return [str(path)] if path and os.path.isfile(str(path)) else []


def dataset_fingerprint(
    dataset: Any, cache_dir: str | os.PathLike | None = None
) -> list[dict[str, Any]] | None:
    """``[{"file", "bytes", "digest"}, ...]`` for the files of ``dataset.storage`` in reading
    order; ``None`` for a dataset without a storage (made in code: nothing to check)."""
    storage = getattr(dataset, "storage", None)
    files = storage_files(storage) if storage is not None else []
    if not files:
        return None
    return [
        {
            "file": os.path.realpath(p),
            "bytes": os.path.getsize(p),
            "digest": file_digest(p, cache_dir),
        }
        for p in files
    ]


def _describe(entries: Sequence[Mapping[str, Any]]) -> str:
    names = [str(e.get("file")) for e in entries]
    shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
    return f"{len(names)} file{'s' if len(names) != 1 else ''} ({shown})"


def data_changes(saved: Mapping[str, Any], current: Mapping[str, Any]) -> dict[str, list[str]]:
    """What differs between two fingerprints ``{split: [file entries] | None}``, by split:
    one line per changed file (or one for a different number of files). Files are matched by
    position and compared by content: data moved or prepared elsewhere is the same data.
    Splits absent on either side are not compared."""
    changes: dict[str, list[str]] = {}
    for split in saved:
        old, new = saved.get(split), current.get(split)
        if not old or not new:
            continue
        lines: list[str] = []
        if len(old) != len(new):
            lines.append(f"the checkpoint's data was {_describe(old)}, now {_describe(new)}")
        else:
            for before, now in zip(old, new):
                if before.get("digest") == now.get("digest"):
                    continue
                what = (
                    f"{before['bytes']} -> {now['bytes']} bytes"
                    if before.get("bytes") != now.get("bytes")
                    else f"same size ({now['bytes']} bytes), different content"
                )
                where = now["file"]
                if before.get("file") != now["file"]:
                    where += f" (the checkpoint read {before.get('file')})"
                lines.append(f"{where}: {what}")
        if lines:
            changes[split] = lines
    return changes
