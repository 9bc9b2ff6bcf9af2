"""What every storage shares: the ``Storage`` interface, the data errors, the token dtype and
the tokenizer-fingerprint check that keeps ids from one vocabulary out of another model."""

from __future__ import annotations

import logging
import os
from abc import ABC, abstractmethod
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from astrai.tokenizer import AutoTokenizer

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
        tokenizer = AutoTokenizer.from_pretrained(str(path))
    return str(tokenizer.fingerprint)


def read_range(
    where: str,
    bounds: np.ndarray,
    start: int,
    stop: int,
    read: Callable[[int, int, int], np.ndarray],
) -> np.ndarray:
    """Tokens `start:stop` (int64) of a key stored in consecutive segments (shards, documents)
    whose cumulative token counts are `bounds`; `read(segment, lo, hi)` returns tokens
    `lo:hi` of one segment. A range outside `0:bounds[-1]` is an IndexError naming `where`."""
    total = int(bounds[-1])
    if not 0 <= start <= stop <= total:
        raise IndexError(f"{where}: token range {start}:{stop} outside 0:{total}")
    parts = []
    segment = int(np.searchsorted(bounds, start, side="right")) - 1
    pos = start
    while pos < stop:
        base, end = int(bounds[segment]), int(bounds[segment + 1])
        take = min(stop, end)
        if take > pos:
            parts.append(read(segment, pos - base, take - base))
        pos = take
        segment += 1
    if not parts:
        return np.zeros(0, dtype=np.int64)
    return np.concatenate(parts).astype(np.int64, copy=False)


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
        """Document ``index`` of ``key``: an int64 array for token keys (float32 for float
        keys such as ``teacher_topk_logprobs``), else the raw value."""

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
