"""The prepared-data cache of training runs, and the lock that keeps concurrent runs apart.

A dataset spec with a ``prepare:`` block is tokenized once into
``<data_dir>/prepared/<kind>-<hash>``. The hash covers the kind, the source, the prepare
options, the tokenizer fingerprint and, for files, their size and mtime: every process (each
DDP rank, each sweep job) computes the same path without talking to the others, and a changed
input or tokenizer gets a fresh folder instead of a stale cache. Writers hold a file lock, so
two runs that need the same data prepare it once.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from astrai.data.inputs import BUILTIN_PREFIX, is_record_source
from astrai.data.prepare import PrepareResult, output_path, prepare
from astrai.data.shards import DamagedOutputError
from astrai.data.teacher_topk import teacher_files_stat

log = logging.getLogger(__name__)


def digest(obj: Any, n: int = 12) -> str:
    """A short stable hash of a JSON-able value (dict keys sorted), for cache folder names."""
    text = json.dumps(obj, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:n]


@contextlib.contextmanager
def file_lock(path: str | os.PathLike) -> Iterator[None]:
    """Hold an exclusive ``flock`` on ``path`` (created if needed): serialises preparation
    between concurrent processes (sweep jobs, DDP ranks, two sweeps) on one file system."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


@dataclass(frozen=True)
class PreparedSource:
    """One ``prepare`` run into the cache: ``path`` is known before it runs."""

    kind: str
    source: Any  # a path, a ``builtin:`` name or a record source (astrai.data.onpolicy)
    folder: Path
    options: dict[str, Any] = field(default_factory=dict)

    @property
    def path(self) -> str:
        """What ``prepare`` writes: the dataset's ``source`` once prepared."""
        return str(output_path(self.folder, self.options["name"], self.options.get("shard_size")))

    def run(self, tokenizer: Any) -> PrepareResult:
        """Prepare under the folder's lock; a finished folder is reused (``prepare`` checks
        its signature), so the ranks and runs that come second do no work. A damaged one
        (cut short, unreadable) is prepared again: the cache is ours to rewrite."""
        with file_lock(self.folder.with_suffix(".lock")):
            try:
                return prepare(self.kind, self.source, self.folder, tokenizer, **self.options)
            except DamagedOutputError as err:
                log.warning("prepared-data cache: %s; preparing it again", err)
                options = {**self.options, "overwrite": True}
                return prepare(self.kind, self.source, self.folder, tokenizer, **options)


def prepared_source(
    kind: str,
    source: Any,
    options: Mapping[str, Any],
    *,
    fingerprint: str,
    data_dir: str | os.PathLike,
    name: str,
) -> PreparedSource:
    """Where ``source`` prepared as ``kind`` with ``options`` (a spec's ``prepare:`` block,
    without ``kind``) and this tokenizer lives in the cache under ``data_dir``."""
    options = dict(options)
    if is_record_source(source):  # records made in code: keyed on what determines them
        ident: dict[str, Any] = {"kind": kind, "source": source.identity(), "prepare": options}
    else:
        source = str(source)
        ident = {"kind": kind, "source": source, "prepare": options}
        if not source.startswith(BUILTIN_PREFIX):  # a changed file must not reuse a stale cache
            st = Path(source).stat()
            ident["stat"] = [st.st_size, st.st_mtime_ns]
    ident["tok"] = fingerprint
    if options.get("teacher"):  # a retrained teacher at the same path: a new folder
        ident["teacher"] = teacher_files_stat(options["teacher"])
    folder = Path(data_dir) / "prepared" / f"{kind}-{digest(ident)}"
    options.setdefault("name", name)
    options.setdefault("progress", True)  # a bar on a terminal (astrai.data.prepare)
    return PreparedSource(kind, source, folder, options)
