"""Token storages: HDF5 shards written by ``prepare`` and plain JSON / JSONL files.

Both storages hold *documents* by *key* (``input_ids``, ``loss_mask``, ...) and read lazily:
opening a storage reads metadata only, ``get(key, i)`` reads one document and
``slice(key, start, stop)`` reads a global token range, so a corpus far larger than memory
can be indexed at random.

HDF5 layout of one shard (``FORMAT_VERSION`` 1)::

    /<key>            1-D token array, all documents concatenated (uint16/uint32, masks uint8;
                      float32 for ``teacher_topk_logprobs``: ``astrai.data.teacher_topk``)
    /offsets/<key>    int64 [num_documents + 1], document i is <key>[off[i]:off[i + 1]]
    /<string key>     variable-length UTF-8 strings, one per document (e.g. ``records``)
    attrs             format_version, kind, tokenizer_fingerprint, vocab_size, keys,
                      string_keys, num_documents, num_tokens, stats, signature

Several shards (a directory or a list of files) read as one storage, documents in file order.
h5py handles are opened on first access in each process and never pickled, so a storage can be
handed to DataLoader workers (fork or spawn) and DDP ranks.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from astrai.data.storage.base import (
    FORMAT_VERSION,
    H5_SUFFIXES,
    JSON_SUFFIXES,
    OFFSETS_GROUP,
    DataError,
    FingerprintMismatchError,
    Storage,
    fingerprint_of,
    token_dtype,
)
from astrai.data.storage.h5 import H5Storage, H5Writer, resolve_h5_paths
from astrai.data.storage.jsonl import JsonStorage, write_jsonl

__all__ = [
    "FORMAT_VERSION",
    "H5_SUFFIXES",
    "JSON_SUFFIXES",
    "OFFSETS_GROUP",
    "DataError",
    "FingerprintMismatchError",
    "H5Storage",
    "H5Writer",
    "JsonStorage",
    "Storage",
    "fingerprint_of",
    "open_storage",
    "resolve_h5_paths",
    "token_dtype",
    "write_jsonl",
]


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
