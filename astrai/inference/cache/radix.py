"""Prefix caches: `RadixCache` shares complete KV pages of prompt prefixes between requests;
`NoPrefixCache` shares nothing (SGLang's `ChunkCache` idea), so the pool never asks which.

In the radix tree each edge is one full page of token ids under a given parent, so a page is reused only
when the whole prefix before it is identical. Matching compares the exact token tuples;
the hash kept on each node is for introspection and never decides a match. A `namespace`
(a LoRA adapter's id; None: the base model) selects one of several trees: KV computed under
one adapter is never served to a request of another (SGLang keys its tree the same way).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any

from astrai.inference.cache.allocator import PageAllocator


@dataclass(eq=False)
class RadixNode:
    tokens: tuple[int, ...]
    page: int
    parent: RadixNode | None
    hash: int
    children: dict[tuple[int, ...], RadixNode] = field(default_factory=dict)


class PrefixCache(ABC):
    """Finds the cached pages of a prompt's prefix and indexes the pages a request wrote."""

    @abstractmethod
    def match(self, token_ids: list[int], namespace: int | None = None) -> list[int]:
        """Pages holding the longest cached page-aligned prefix of `token_ids`."""

    @abstractmethod
    def insert(self, token_ids: list[int], pages: list[int], namespace: int | None = None) -> int:
        """Index the complete pages of `token_ids`, stored in `pages`; returns pages added."""

    @abstractmethod
    def reset(self) -> None:
        """Forget every entry (e.g. after a weight update made the cached KV stale)."""

    @property
    @abstractmethod
    def cached_tokens(self) -> int:
        """Tokens whose KV the cache holds."""

    def stats(self) -> dict[str, Any]:
        return {}


class NoPrefixCache(PrefixCache):
    """Shares nothing: every request computes its whole prompt."""

    def match(self, token_ids: list[int], namespace: int | None = None) -> list[int]:
        return []

    def insert(self, token_ids: list[int], pages: list[int], namespace: int | None = None) -> int:
        return 0

    def reset(self) -> None:
        pass

    @property
    def cached_tokens(self) -> int:
        return 0


class RadixCache(PrefixCache):
    """Page-aligned prefix index whose pages are owned (as 'cached') in a `PageAllocator`."""

    def __init__(self, allocator: PageAllocator, page_size: int) -> None:
        self.allocator = allocator
        self.page_size = page_size
        self.roots: dict[int | None, RadixNode] = {}
        self._by_page: dict[int, RadixNode] = {}
        allocator.on_evict = self._evict
        self.queried_tokens = 0
        self.hit_tokens = 0

    @property
    def num_pages(self) -> int:
        return len(self._by_page)

    @property
    def cached_tokens(self) -> int:
        return len(self._by_page) * self.page_size

    def stats(self) -> dict[str, Any]:
        queried = self.queried_tokens
        return {
            "prefix_cached_tokens": self.cached_tokens,
            "prefix_hit_rate": self.hit_tokens / queried if queried else 0.0,
        }

    def _pages_of(self, token_ids: list[int]) -> list[tuple[int, ...]]:
        ps = self.page_size
        return [tuple(token_ids[i : i + ps]) for i in range(0, len(token_ids) - ps + 1, ps)]

    def root(self, namespace: int | None = None) -> RadixNode:
        """The tree of `namespace` (created on first use)."""
        node = self.roots.get(namespace)
        if node is None:
            node = self.roots[namespace] = RadixNode(tokens=(), page=-1, parent=None, hash=0)
        return node

    def match(self, token_ids: list[int], namespace: int | None = None) -> list[int]:
        """Pages holding the longest cached page-aligned prefix of `token_ids`."""
        node, pages = self.root(namespace), []
        for key in self._pages_of(token_ids):
            child = node.children.get(key)
            if child is None:
                break
            pages.append(child.page)
            node = child
        # Touch leaf to root, so ancestors are the most recent and leaves are evicted first.
        self.allocator.touch(pages[::-1])
        self.queried_tokens += len(token_ids)
        self.hit_tokens += len(pages) * self.page_size
        return pages

    def insert(self, token_ids: list[int], pages: list[int], namespace: int | None = None) -> int:
        """Index the complete pages of `token_ids`, stored in `pages`; returns pages added.

        Where an identical page already exists under the same parent the tree keeps its
        own copy, and the caller's page stays private (freed when its request ends).
        """
        node, added = self.root(namespace), 0
        for key, page in zip(self._pages_of(token_ids), pages):
            child = node.children.get(key)
            if child is None:
                if page in self._by_page:  # indexed elsewhere (cannot happen for fresh pages)
                    break
                child = RadixNode(tokens=key, page=page, parent=node, hash=hash((node.hash, key)))
                node.children[key] = child
                self._by_page[page] = child
                self.allocator.mark_cached(page)
                added += 1
            node = child
        return added

    def _evict(self, page: int) -> list[int]:
        node = self._by_page.pop(page, None)
        if node is None:
            return []
        if node.parent is not None:
            node.parent.children.pop(node.tokens, None)
        dropped, stack = [], list(node.children.values())
        while stack:
            child = stack.pop()
            self._by_page.pop(child.page, None)
            dropped.append(child.page)
            stack.extend(child.children.values())
        return dropped

    def reset(self) -> None:
        for page in list(self._by_page):
            self.allocator.uncache(page)
        self._by_page.clear()
        self.roots.clear()
