"""Which KV slots back each request row: the two cache modes as two allocator types.

`KVAllocator` is the one interface the pool talks to (SGLang's allocator seam):
`can_hold` / `open` / `ensure` / `free` / `pages` / `used_tokens` / `holds_nothing`,
`arrange` (the mode's own admission order of rows) and `release_unread` (pages a sliding
window will never read again). Both write the request-to-token table,
position -> physical slot, of the rows they back.

- `ContiguousAllocator`: row `r` owns the fixed slots `r * max_seq_len + position`; nothing
  is allocated while serving and no page is ever shared.
- `PagedAllocator`: rows take pages of `page_size` tokens on demand from a `PageAllocator`
  (free set, reference counts, LRU of prefix-cached pages), so a prefix cache can share them.

A sliding-window model (every layer windowed: `window`) reads only the last `window`
positions of a row, so a paged row gives back the pages wholly before its window as it
decodes (`release_unread`, vLLM's sliding-window manager's rule): they keep their place in
the row as holes (the kernels never read them) and the row's prefix is no longer cacheable
past them (its prompt's pages entered the prefix cache when its prefill completed).

A page is owned by the requests that reference it (ref count) and, optionally, by the
prefix cache. A page that no request references goes back to the free set, unless the
prefix cache holds it: then it waits in an LRU list and is evicted (oldest first) only
when an allocation would otherwise fail.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Callable

import torch

_HOLE = -1  # a released page's place in its row


class PageAllocator:
    """Hands out page ids `0 .. num_pages - 1`, with reference counts and an LRU."""

    def __init__(self, num_pages: int) -> None:
        if num_pages <= 0:
            raise ValueError(f"num_pages must be positive, got {num_pages}")
        self.num_pages = num_pages
        self._free: list[int] = list(range(num_pages - 1, -1, -1))  # pop() gives low ids first
        self._refs = [0] * num_pages
        self._cached = [False] * num_pages
        self._lru: OrderedDict[int, None] = OrderedDict()  # cached pages with zero refs
        # Called with a page the LRU evicts; returns further pages that became unreachable
        # (descendants in the prefix tree), which are freed as well.
        self.on_evict: Callable[[int], list[int]] | None = None

    # ------------------------------------------------------------------ queries
    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_evictable(self) -> int:
        return len(self._lru)

    @property
    def num_available(self) -> int:
        return len(self._free) + len(self._lru)

    @property
    def num_used(self) -> int:
        return self.num_pages - len(self._free)

    # ------------------------------------------------------------------ allocation
    def alloc(self, n: int) -> list[int] | None:
        """`n` pages with ref count 1 each, evicting cached pages if needed; None if impossible."""
        if n > self.num_available:
            return None
        while len(self._free) < n and self._lru:
            self._evict_one()
        if len(self._free) < n:
            return None
        pages = [self._free.pop() for _ in range(n)]
        for p in pages:
            self._refs[p] = 1
        return pages

    def ref(self, pages: list[int]) -> None:
        """Take another reference (a request reusing cached pages)."""
        for p in pages:
            if self._refs[p] == 0:
                if not self._cached[p]:
                    raise RuntimeError(f"page {p} is free; it cannot be referenced")
                self._lru.pop(p, None)
            self._refs[p] += 1

    def unref(self, pages: list[int]) -> None:
        for p in pages:
            if self._refs[p] <= 0:
                raise RuntimeError(f"page {p} released more often than referenced")
            self._refs[p] -= 1
            if self._refs[p] == 0:
                if self._cached[p]:
                    self._lru[p] = None
                else:
                    self._free.append(p)

    def touch(self, pages: list[int]) -> None:
        """Mark cached zero-ref pages as recently used."""
        for p in pages:
            if p in self._lru:
                self._lru.move_to_end(p)

    # ------------------------------------------------------------------ prefix-cache ownership
    def mark_cached(self, page: int) -> None:
        self._cached[page] = True

    def uncache(self, page: int) -> None:
        """The prefix cache lets go of `page`; it is freed now if no request holds it."""
        if not self._cached[page]:
            return
        self._cached[page] = False
        if self._refs[page] == 0:
            self._lru.pop(page, None)
            self._free.append(page)

    def _evict_one(self) -> None:
        page, _ = self._lru.popitem(last=False)
        self._lru[page] = None  # uncache() below removes it together with its descendants
        extra = self.on_evict(page) if self.on_evict is not None else []
        for p in [page, *extra]:
            self.uncache(p)


class KVAllocator(ABC):
    """Backs positions of request rows with KV slots of the request-to-token `table`.

    Row ids come from the pool's request table; lengths never exceed the table's width
    (the pool checks that). `page_size` is the sharing granularity of the mode.
    """

    page_size: int
    # Set when row r owns the fixed slots `r * row_stride + position`: attention backends
    # may then read K/V through a strided view instead of gathering.
    row_stride: int | None = None

    def __init__(self, table: torch.Tensor) -> None:
        self.table = table

    @abstractmethod
    def can_hold(self, num_tokens: int, reserve_pages: int = 0) -> bool:
        """Could a new row of `num_tokens` be backed now, keeping `reserve_pages` spare?"""

    @abstractmethod
    def open(self, row: int, shared_pages: list[int]) -> None:
        """Start backing `row`; its first positions reuse `shared_pages` (already cached)."""

    @abstractmethod
    def ensure(self, row: int, length: int) -> bool:
        """Back positions `[0, length)` of `row`; False if memory ran out."""

    @abstractmethod
    def free(self, row: int) -> None:
        """Release what `row` holds."""

    @abstractmethod
    def pages(self, row: int) -> list[int]:
        """The shareable pages backing `row`, in position order."""

    @property
    @abstractmethod
    def used_tokens(self) -> int:
        """KV slots held by requests (prefix-cached pages nobody uses are not counted)."""

    @abstractmethod
    def holds_nothing(self) -> bool:
        """True when no row holds KV (prefix-cached pages count as reclaimable)."""

    def arrange(self, rows: list[int], lengths: list[int]) -> list[int]:
        """Rows for the requests of one admission, given in admission order (default: as is)."""
        return rows

    def release_unread(self, row: int, length: int) -> None:
        """`row` is `length` long and its next queries start at position `length - 1`: give
        back what no query will read again (default: nothing; every position stays read)."""
        return None


class ContiguousAllocator(KVAllocator):
    """Each row owns `max_seq_len` fixed slots: a linear table, nothing allocated later."""

    def __init__(self, table: torch.Tensor) -> None:
        super().__init__(table)
        num_rows, width = table.shape
        self.page_size = width
        self.row_stride = width
        rows = torch.arange(num_rows, device=table.device)[:, None] * width
        table.copy_(rows + torch.arange(width, device=table.device))
        self._open: set[int] = set()

    def can_hold(self, num_tokens: int, reserve_pages: int = 0) -> bool:
        return True

    def open(self, row: int, shared_pages: list[int]) -> None:
        if shared_pages:
            raise ValueError("contiguous rows share no pages")
        self._open.add(row)

    def ensure(self, row: int, length: int) -> bool:
        return True

    def free(self, row: int) -> None:
        self._open.discard(row)

    def pages(self, row: int) -> list[int]:
        return []

    @property
    def used_tokens(self) -> int:
        return len(self._open) * self.page_size

    def holds_nothing(self) -> bool:
        return not self._open

    def arrange(self, rows: list[int], lengths: list[int]) -> list[int]:
        """Hand the rows of one admission out by prompt length, shortest first.

        Nothing is written before the first forward, so the rows can be swapped. Neighbouring
        rows then hold requests of similar length (all grow by one per step), and the CPU
        decode attention, which reads ranges of rows padded to their longest, pads much less.
        """
        if len(rows) < 2:
            return rows
        order = sorted(range(len(rows)), key=lengths.__getitem__)
        out = list(rows)
        for row, i in zip(sorted(rows), order):
            out[i] = row
        return out


class PagedAllocator(KVAllocator):
    """Rows take `page_size`-token pages on demand from a shared `PageAllocator`."""

    def __init__(
        self, table: torch.Tensor, num_pages: int, page_size: int, window: int | None = None
    ) -> None:
        super().__init__(table)
        if page_size <= 0:
            raise ValueError(f"page_size must be positive, got {page_size}")
        if window is not None and window <= 0:
            raise ValueError(f"window must be positive, got {window}")
        self.page_size = page_size
        self.window = window  # every layer's (the largest): None, a layer attends fully
        self.page_allocator = PageAllocator(num_pages)
        self._rows: dict[int, list[int]] = {}  # released pages are holes: _HOLE
        self._released: dict[int, int] = {}  # row -> leading pages released

    def can_hold(self, num_tokens: int, reserve_pages: int = 0) -> bool:
        need = -(-num_tokens // self.page_size) + reserve_pages
        return need <= self.page_allocator.num_available

    def open(self, row: int, shared_pages: list[int]) -> None:
        if shared_pages:
            self.page_allocator.ref(shared_pages)
            self._write(row, 0, shared_pages)
        self._rows[row] = list(shared_pages)

    def ensure(self, row: int, length: int) -> bool:
        pages = self._rows[row]
        need = -(-length // self.page_size) - len(pages)
        if need <= 0:
            return True
        new = self.page_allocator.alloc(need)
        if new is None:
            return False
        self._write(row, len(pages), new)
        pages.extend(new)
        return True

    def free(self, row: int) -> None:
        pages = self._rows.pop(row)[self._released.pop(row, 0) :]
        if pages:  # leaf pages first, so they are older in the LRU than the prefix they extend
            self.page_allocator.unref(pages[::-1])

    def pages(self, row: int) -> list[int]:
        """The row's pages from position 0; none once its window released the first."""
        return [] if self._released.get(row) else self._rows[row]

    def release_unread(self, row: int, length: int) -> None:
        """Pages wholly before the window of the query at `length - 1` go back (their
        references dropped: the prefix cache may still hold them)."""
        if self.window is None:
            return
        pages, done = self._rows[row], self._released.get(row, 0)
        until = min(max(length - self.window, 0) // self.page_size, len(pages))
        if until <= done:
            return
        gone = pages[done:until]
        pages[done:until] = [_HOLE] * len(gone)
        self._released[row] = until
        self.page_allocator.unref(gone[::-1])

    @property
    def used_tokens(self) -> int:
        alloc = self.page_allocator
        return (alloc.num_used - alloc.num_evictable) * self.page_size

    def holds_nothing(self) -> bool:
        alloc = self.page_allocator
        return not self._rows and alloc.num_used == alloc.num_evictable

    def _write(self, row: int, first_page: int, pages: list[int]) -> None:
        ps = self.page_size
        start = first_page * ps
        slots = (torch.tensor(pages, dtype=torch.int32)[:, None] * ps + torch.arange(ps)).flatten()
        end = min(start + slots.numel(), self.table.shape[1])
        self.table[row, start:end] = slots[: end - start].to(self.table.device)
