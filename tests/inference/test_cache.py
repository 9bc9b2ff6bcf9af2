"""KV cache layers: allocator ref counts and LRU eviction, radix matching, pool binding."""

import random

import pytest
import torch

from astrai.inference.cache import Allocator, PagePool, RadixCache


def test_allocator_refcounts_and_free():
    a = Allocator(4)
    pages = a.alloc(3)
    assert sorted(pages) == [0, 1, 2] and a.num_free == 1
    a.ref(pages[:1])
    a.unref(pages)
    assert a.num_free == 3 and a.refs(pages[0]) == 1
    a.unref(pages[:1])
    assert a.num_free == 4
    with pytest.raises(RuntimeError, match="released"):
        a.unref(pages[:1])
    assert a.alloc(5) is None


def test_cached_pages_wait_in_lru_and_are_evicted_oldest_first():
    a = Allocator(3)
    radix = RadixCache(a, page_size=2)
    p = a.alloc(3)
    radix.insert([1, 2, 3, 4], p[:2])  # chain p0 -> p1
    radix.insert([9, 9], p[2:])
    a.unref([p[1], p[0]])  # leaf first: p1 older than p0
    a.unref([p[2]])
    assert a.num_free == 0 and a.num_evictable == 3
    got = a.alloc(1)
    assert got == [p[1]]  # the oldest leaf went first
    assert radix.match([1, 2, 3, 4, 5]) == [p[0]]
    assert radix.match([9, 9, 1]) == [p[2]]


def test_evicting_a_parent_drops_its_subtree():
    a = Allocator(3)
    radix = RadixCache(a, page_size=1)
    p = a.alloc(3)
    radix.insert([5, 6, 7], p)
    a.unref(p)  # root-most page is oldest, so it is evicted first
    assert a.alloc(1)[0] in p
    assert a.num_free == 2  # descendants became unreachable and were freed
    assert radix.match([5, 6, 7]) == []
    assert radix.num_pages == 0


def test_radix_matches_only_under_the_same_parent():
    a = Allocator(8)
    radix = RadixCache(a, page_size=2)
    p = a.alloc(2)
    radix.insert([1, 2, 3, 4], p)
    assert radix.match([1, 2, 3, 4, 9]) == p
    assert radix.match([1, 2, 3]) == p[:1]  # partial last page never matches
    assert radix.match([3, 4, 1, 2]) == []  # same page content, different parent
    q = a.alloc(2)
    assert radix.insert([1, 2, 3, 4], q) == 0  # duplicates keep the tree's copy
    radix.reset()
    assert radix.match([1, 2, 3, 4]) == []


def make_pool(**kw):
    args = dict(num_layers=2, num_kv_heads=2, head_dim=4, max_batch_size=4, max_seq_len=32)
    return PagePool(**{**args, **kw})


def test_contiguous_rows_are_linear():
    pool = make_pool()
    row, cached = pool.alloc_task([1, 2, 3])
    assert cached == 0
    assert pool.ensure(row, 32) and not pool.ensure(row, 33)
    kv = pool.bind_tasks([row], [5], [2])
    assert kv.out_cache_loc.tolist() == [row * 32 + 3, row * 32 + 4]
    assert kv.kv_indptr.tolist() == [0, 5] and kv.qo_indptr.tolist() == [0, 2]


def test_paged_binding_and_prefix_sharing():
    pool = make_pool(mode="paged", page_size=4, kv_tokens=64)
    prompt = list(range(10))
    row, cached = pool.alloc_task(prompt)
    assert cached == 0 and pool.ensure(row, len(prompt))
    kv = pool.bind_tasks([row], [10], [10])
    slots = kv.out_cache_loc.tolist()
    assert len(set(slots)) == 10 and all(0 <= s < 64 for s in slots)
    pool.cache_task(row, prompt)
    pool.free_task(row)
    assert pool.all_free()
    row2, cached2 = pool.alloc_task([*prompt, 99])
    assert cached2 == 8  # two complete pages shared
    assert pool.ensure(row2, 11)
    kv2 = pool.bind_tasks([row2], [11], [3])
    assert pool.req_pool.req_to_token[row2, :8].tolist() == slots[:8]
    assert kv2.out_cache_loc.tolist()[0] not in slots[:8]  # never writes a shared page
    pool.free_task(row2)
    pool.invalidate_prefix_cache()
    assert pool.alloc_task(prompt)[1] == 0


def test_random_churn_returns_every_page():
    rng = random.Random(0)
    pool = make_pool(mode="paged", page_size=2, kv_tokens=40, max_batch_size=6)
    live = {}
    for _ in range(500):
        if live and (rng.random() < 0.45 or len(live) == 6):
            row = rng.choice(list(live))
            toks = live.pop(row)
            pool.cache_task(row, toks[: rng.randint(0, len(toks))])
            pool.free_task(row)
            continue
        toks = [rng.randint(0, 3) for _ in range(rng.randint(1, 12))]
        got = pool.alloc_task(toks)
        if got is None:
            continue
        row, cached = got
        if not pool.ensure(row, len(toks)):
            pool.free_task(row)
            continue
        assert cached < len(toks)
        live[row] = toks
    for row in list(live):
        pool.free_task(row)
    assert pool.all_free()
    alloc = pool.allocator
    assert alloc.num_free + alloc.num_evictable == alloc.num_pages
    assert alloc.alloc(alloc.num_pages) is not None  # everything is reclaimable


def test_memory_fraction_budget():
    pool = make_pool(mode="paged", page_size=4, memory_fraction=1e-6)
    assert pool.capacity_tokens % 4 == 0 and pool.capacity_tokens > 0
    with pytest.raises(ValueError, match="memory_fraction"):
        make_pool(mode="paged", memory_fraction=2.0)
    with pytest.raises(ValueError, match="cache mode"):
        make_pool(mode="ring")


def test_storage_has_a_scratch_slot():
    pool = make_pool(mode="paged", page_size=4, kv_tokens=16)
    assert pool.storage.k_buffer.shape == (2, 17, 2, 4)
    assert pool.storage.scratch_slot == 16
    assert pool.storage.k_buffer.dtype == torch.float32


@pytest.mark.parametrize(
    ("mode", "head_major", "expected"),
    [("contiguous", None, True), ("paged", None, False), ("paged", True, True)],
)
def test_storage_layout_keeps_the_shape(mode, head_major, expected):
    """CPU contiguous rows default to head-major memory (each head's slots together);
    the buffers keep the [layers, slots, heads, dim] shape and index the same either way."""
    pool = make_pool(mode=mode, page_size=4, kv_tokens=64, head_major=head_major)
    k = pool.storage.k_buffer
    assert pool.storage.head_major is expected
    assert k.shape[2:] == (2, 4) and k.stride(-1) == 1
    assert (k.stride(2) > k.stride(1)) is expected
    k[1, 5] = torch.arange(8.0).view(2, 4)
    assert k[1, 5, 1].tolist() == [4.0, 5.0, 6.0, 7.0]
