"""Train / val assignment of generated or shipped data by a stable hash of a key.

The built-in sources (:mod:`astrai.data.builtin`, :mod:`astrai.data.countdown`) put every item
in one split by a hash of its identity (a file path, an expression, a problem), so the two
splits never share an item and the assignment does not depend on the seed or on how many
items are drawn.
"""

from __future__ import annotations

import hashlib

SPLITS = ("train", "val")


def hash_fraction(text: str) -> float:
    """A stable number in [0, 1) per string (Python's hash() is salted per process)."""
    return int.from_bytes(hashlib.sha256(text.encode("utf-8")).digest()[:8], "big") / 2**64


def in_split(key: str, split: str | None, val_fraction: float) -> bool:
    """Whether the item named `key` belongs to `split` (None: every item does)."""
    if split is None:
        return True
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS} or None, got {split!r}")
    is_val = hash_fraction(key) < val_fraction
    return is_val if split == "val" else not is_val
