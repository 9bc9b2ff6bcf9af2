"""Packing SFT documents into windows of at most ``window_size`` tokens (``prepare pack=true``).

Two strategies, chosen with ``packing_strategy`` (TRL's ``SFTConfig.packing_strategy`` name):

- ``greedy`` (the default, astrai's behaviour before the option existed): documents in input
  order, a window closed as soon as the next document does not fit ("next fit" in bin-packing
  terms). TRL has no such strategy; it streams, holding one window.
- ``bfd``: best-fit decreasing, TRL's ``bfd`` (``trl.data_utils._pack_bfd``): documents sorted
  by length, longest first (ties in input order), each put in the open window with the least
  room that still takes it, a new window when none does; windows written in the order they
  were opened. The same windows as TRL's for the same documents. It sees a whole shard at
  once: a shard's documents are buffered (as compact arrays) until the shard closes, so
  memory is bounded by the shard (``shard_size`` records; the whole input when unsharded).

TRL's ``bfd_split`` and ``wrapped`` cut documents across windows, which breaks a chat's loss
mask and its position ids; astrai does not offer them. Documents never exceed the window:
``PrepareOptions`` caps ``max_length`` at ``window_size`` (longer records are skipped, or cut
by ``truncate`` / ``truncation_mode``).
"""

from __future__ import annotations

import bisect
from collections import deque
from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np


class WindowWriter(Protocol):
    """Where packed windows go (an ``H5Writer``): one call per window."""

    def add(self, **values: Any) -> None: ...


class Packer(Protocol):
    """Takes one shard's documents and writes them as packed windows."""

    windows: int

    def add(self, ids: Sequence[int], mask: Sequence[int]) -> None: ...

    def flush(self) -> None: ...


def greedy_bins(lengths: Sequence[int], capacity: int) -> list[list[int]]:
    """The windows (lists of document indices) that greedy in-order packing makes."""
    bins: list[list[int]] = []
    used = capacity + 1  # no window open yet
    for i, n in enumerate(lengths):
        if used + n > capacity:
            bins.append([])
            used = 0
        bins[-1].append(i)
        used += n
    return bins


def bfd_bins(lengths: Sequence[int], capacity: int) -> list[list[int]]:
    """The windows (lists of document indices) of best-fit decreasing, as TRL's ``_pack_bfd``
    makes them: longest first (a stable sort), into the window with the least room that still
    fits (the one opened first among equals), windows in the order they were opened."""
    order = sorted(range(len(lengths)), key=lambda i: -int(lengths[i]))
    bins: list[list[int]] = []
    by_room: dict[int, deque[int]] = {}  # room left -> windows with that room, oldest first
    rooms: list[int] = []  # the keys of by_room, sorted
    for i in order:
        n = int(lengths[i])
        if n > capacity:
            raise ValueError(f"document {i} has {n} tokens, more than the window's {capacity}")
        at = bisect.bisect_left(rooms, n)
        if at < len(rooms):
            room = rooms[at]
            window = by_room[room].popleft()
            if not by_room[room]:
                del by_room[room]
                rooms.pop(at)
        else:
            room, window = capacity, len(bins)
            bins.append([])
        bins[window].append(i)
        left = room - n
        if left > 0:
            if left not in by_room:
                by_room[left] = deque()
                bisect.insort(rooms, left)
            by_room[left].append(window)
    return bins


def padding_fraction(lengths: Sequence[int], bins: Sequence[Sequence[int]], capacity: int) -> float:
    """The share of window slots left empty when every window is padded to ``capacity``."""
    slots = len(bins) * capacity
    return 1.0 - sum(int(lengths[i]) for b in bins for i in b) / slots if slots else 0.0


class GreedyPacker:
    """Greedy in-order packing: holds the open window only."""

    def __init__(self, writer: WindowWriter, window_size: int) -> None:
        self.writer, self.window_size = writer, window_size
        self.ids: list[int] = []
        self.mask: list[int] = []
        self.pos: list[int] = []
        self.windows = 0

    def add(self, ids: Sequence[int], mask: Sequence[int]) -> None:
        if len(self.ids) + len(ids) > self.window_size:
            self.flush()
        self.ids += ids
        self.mask += mask
        self.pos += range(len(ids))

    def flush(self) -> None:
        if self.ids:
            self.writer.add(input_ids=self.ids, loss_mask=self.mask, position_ids=self.pos)
            self.windows += 1
            self.ids, self.mask, self.pos = [], [], []


class BFDPacker:
    """Best-fit decreasing over one shard: documents are buffered until ``flush`` (the shard's
    end), then packed by :func:`bfd_bins` and written."""

    def __init__(self, writer: WindowWriter, window_size: int) -> None:
        self.writer, self.window_size = writer, window_size
        self.docs: list[tuple[np.ndarray, np.ndarray]] = []
        self.windows = 0

    def add(self, ids: Sequence[int], mask: Sequence[int]) -> None:
        self.docs.append((np.asarray(ids, dtype=np.int32), np.asarray(mask, dtype=np.uint8)))

    def flush(self) -> None:
        docs, self.docs = self.docs, []
        for window in bfd_bins([len(ids) for ids, _ in docs], self.window_size):
            parts = [docs[i] for i in window]
            self.writer.add(
                input_ids=np.concatenate([ids for ids, _ in parts]),
                loss_mask=np.concatenate([mask for _, mask in parts]),
                position_ids=np.concatenate([np.arange(len(ids)) for ids, _ in parts]),
            )
            self.windows += 1


PACKERS: dict[str, type[GreedyPacker] | type[BFDPacker]] = {
    "greedy": GreedyPacker,
    "bfd": BFDPacker,
}
PACKING_STRATEGIES = tuple(PACKERS)


def make_packer(strategy: str, writer: WindowWriter, window_size: int) -> Packer:
    """The packer of ``packing_strategy`` (one of :data:`PACKING_STRATEGIES`; ``PrepareOptions``
    checks the name before any input is read)."""
    return PACKERS[strategy](writer, window_size)
