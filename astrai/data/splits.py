"""Train / val assignment of generated or shipped data by a stable hash of a key.

The built-in sources (:mod:`astrai.data.builtin`, :mod:`astrai.data.countdown`) put every item
in one split by a hash of its identity (a file path, an expression, a problem), so the two
splits never share an item and the assignment does not depend on the seed or on how many
items are drawn.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from typing import TypeVar

SPLITS = ("train", "val")

T = TypeVar("T")
#: One random draw: None (rejected), or the item's key and how to build it from its index.
Draw = Callable[[], "tuple[str, Callable[[int], T]] | None"]


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


def draw_in_split(
    draw: Draw,
    n: int,
    *,
    split: str | None,
    val_fraction: float,
    unique: bool,
    what: str,
) -> list[T]:
    """``n`` items of ``split`` from repeated ``draw()`` calls: a draw is kept when its key is
    in the split (and, with ``unique``, not kept before), then built from its index. Gives up
    with a ValueError naming ``what`` (the generator and its settings) after ``1000 * (n +
    10)`` draws, when the split holds fewer distinct items than asked for."""
    items: list[T] = []
    seen: set[str] = set()
    attempts = 0
    while len(items) < n:
        attempts += 1
        if attempts > 1000 * (n + 10):
            raise ValueError(
                f"{what}: cannot draw {n} {'distinct ' if unique else ''}problems of split "
                f"{split!r}; ask for fewer"
            )
        drawn = draw()
        if drawn is None:
            continue
        key, build = drawn
        if not in_split(key, split, val_fraction) or key in seen:
            continue
        if unique:
            seen.add(key)
        items.append(build(len(items)))
    return items
