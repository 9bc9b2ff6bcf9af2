"""KV cache system: storage, request table, allocators (the cache modes) and prefix caches."""

from astrai.inference.cache.allocator import (
    ContiguousAllocator,
    KVAllocator,
    PageAllocator,
    PagedAllocator,
)
from astrai.inference.cache.pool import KVStorage, PagePool, ReqToTokenPool
from astrai.inference.cache.radix import NoPrefixCache, PrefixCache, RadixCache

__all__ = [
    "ContiguousAllocator",
    "KVAllocator",
    "KVStorage",
    "NoPrefixCache",
    "PageAllocator",
    "PagePool",
    "PagedAllocator",
    "PrefixCache",
    "RadixCache",
    "ReqToTokenPool",
]
