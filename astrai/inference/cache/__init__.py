"""KV cache system: storage, request table, page allocator and radix prefix cache."""

from astrai.inference.cache.allocator import Allocator
from astrai.inference.cache.pool import KVStorage, PagePool, ReqToTokenPool
from astrai.inference.cache.radix import RadixCache

__all__ = ["Allocator", "KVStorage", "PagePool", "RadixCache", "ReqToTokenPool"]
