"""Page allocator for the paged KV pool: free set, reference counts, LRU of cached pages.

A page is owned by the requests that reference it (ref count) and, optionally, by the
prefix cache. A page that no request references goes back to the free set, unless the
prefix cache holds it: then it waits in an LRU list and is evicted (oldest first) only
when an allocation would otherwise fail.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable


class Allocator:
    """Hands out page ids `0 .. num_pages - 1`."""

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

    def refs(self, page: int) -> int:
        return self._refs[page]

    def is_cached(self, page: int) -> bool:
        return self._cached[page]

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
