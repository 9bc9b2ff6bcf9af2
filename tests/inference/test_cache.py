"""KV cache layers: page ref counts and LRU eviction, radix matching, the two allocator
types and the null prefix cache, pool binding."""

import random

import pytest
import torch

from astrai.inference.cache import (
    ContiguousAllocator,
    NoPrefixCache,
    PageAllocator,
    PagedAllocator,
    PagePool,
    RadixCache,
)


def test_allocator_refcounts_and_free():
    a = PageAllocator(4)
    pages = a.alloc(3)
    assert sorted(pages) == [0, 1, 2] and a.num_free == 1
    a.ref(pages[:1])
    a.unref(pages)
    assert a.num_free == 3  # the page taken twice is still held once
    a.unref(pages[:1])
    assert a.num_free == 4
    with pytest.raises(RuntimeError, match="released"):
        a.unref(pages[:1])
    assert a.alloc(5) is None


def test_cached_pages_wait_in_lru_and_are_evicted_oldest_first():
    a = PageAllocator(3)
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
    a = PageAllocator(3)
    radix = RadixCache(a, page_size=1)
    p = a.alloc(3)
    radix.insert([5, 6, 7], p)
    a.unref(p)  # root-most page is oldest, so it is evicted first
    assert a.alloc(1)[0] in p
    assert a.num_free == 2  # descendants became unreachable and were freed
    assert radix.match([5, 6, 7]) == []
    assert radix.num_pages == 0


def test_radix_matches_only_under_the_same_parent():
    a = PageAllocator(8)
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


def test_contiguous_rows_share_nothing_and_count_whole_rows():
    pool = make_pool()
    assert isinstance(pool.allocator, ContiguousAllocator)
    assert isinstance(pool.prefix, NoPrefixCache)
    assert pool.slot_table[2, :3].tolist() == [64, 65, 66]
    assert pool.can_hold(32) and not pool.can_hold(33)
    row, _ = pool.alloc_task(list(range(10)))
    assert pool.used_tokens == 32 and not pool.all_free()
    pool.cache_task(row, list(range(10)))  # nothing to index
    pool.free_task(row)
    assert pool.all_free() and pool.used_tokens == 0
    assert pool.alloc_task(list(range(10)))[1] == 0  # no prefix reuse
    assert pool.cached_tokens == 0 and "prefix_hit_rate" not in pool.stats()


@pytest.mark.parametrize("mode", ["contiguous", "paged"])
def test_rows_of_one_admission_are_placed_by_the_allocator(mode):
    """Contiguous rows are handed out shortest prompt first (neighbouring rows then have
    similar lengths, which the CPU decode attention pads less); paged rows stay as they are."""
    pool = make_pool(mode=mode, page_size=4, kv_tokens=64, max_batch_size=8)
    rows, lengths = [0, 1, 2, 3, 4], [40, 5, 23, 9, 31]
    placed = pool.arrange_rows(rows, lengths)
    assert sorted(placed) == rows
    by_row = [n for _, n in sorted(zip(placed, lengths))]
    assert by_row == (sorted(lengths) if mode == "contiguous" else lengths)
    assert pool.arrange_rows([3], [7]) == [3]


def test_paged_without_prefix_cache_frees_pages_at_once():
    pool = make_pool(mode="paged", page_size=4, kv_tokens=32, enable_radix=False)
    assert isinstance(pool.allocator, PagedAllocator) and isinstance(pool.prefix, NoPrefixCache)
    prompt = list(range(10))
    row, _ = pool.alloc_task(prompt)
    assert pool.ensure(row, 10) and pool.used_tokens == 12
    assert not pool.can_hold(24) and pool.can_hold(20)
    assert not pool.can_hold(8, reserve_pages=4)
    pool.cache_task(row, prompt)
    pool.free_task(row)
    assert pool.all_free() and pool.used_tokens == 0
    assert pool.allocator.page_allocator.num_free == 8  # nothing waits in an LRU
    assert pool.alloc_task(prompt)[1] == 0


def test_the_peak_of_kv_in_use_outlives_the_requests():
    """The high-water mark the scaling bench reports: kept after the rows are freed, reset
    to what is held now."""
    pool = make_pool(mode="paged", page_size=4, kv_tokens=64, enable_radix=False)
    a, _ = pool.alloc_task(list(range(5)))
    b, _ = pool.alloc_task(list(range(3)))
    assert pool.ensure(a, 9) and pool.ensure(b, 3)
    assert pool.used_tokens == pool.peak_used_tokens == 16
    pool.free_task(a)
    assert pool.used_tokens == 4 and pool.peak_used_tokens == 16
    pool.reset_peak_used_tokens()
    assert pool.peak_used_tokens == 4
    pool.free_task(b)
    assert pool.peak_used_tokens == 4


def test_a_windowed_row_gives_back_the_pages_behind_its_window():
    """Window 6, pages of 4: at length 15 the query at 14 reads positions 9.. (page 2 on),
    so pages 0 and 1 go back; a prefix-cached page stays in the cache; the row is no longer
    cacheable from position 0; freeing the row returns the rest once."""
    pool = make_pool(mode="paged", page_size=4, kv_tokens=64, window=6)
    prompt = list(range(9))
    a, _ = pool.alloc_task(prompt)
    assert pool.ensure(a, 9)
    pool.cache_task(a, prompt)  # its prefill completed: pages 0 and 1 are indexed
    b, cached = pool.alloc_task(prompt)  # a second request shares them
    assert cached == 8 and pool.ensure(b, 9)
    assert pool.ensure(a, 15) and pool.used_tokens == 20  # a: 4 pages, b: 1 own page
    pool.release_unread(a, 14)  # the query at 13 reads 8..: page 2 is still read
    pool.release_unread(a, 15)
    assert pool.used_tokens == 20  # pages 0 and 1 are b's too
    assert pool.allocator.pages(a) == []  # no longer a prefix from position 0
    pool.release_unread(b, 9)  # the query at 8 reads 3..: nothing wholly behind it
    assert pool.used_tokens == 20
    pool.free_task(b)
    assert pool.used_tokens == 8  # a's pages 2 and 3
    assert pool.prefix.match(prompt) != []  # the cached prefix outlived both references
    pool.free_task(a)
    assert pool.all_free() and pool.used_tokens == 0
    contiguous = make_pool(window=6)
    c, _ = contiguous.alloc_task(prompt)
    contiguous.release_unread(c, 30)  # a contiguous row owns its slots: nothing to give back
    assert contiguous.used_tokens == 32


def test_paged_binding_and_prefix_sharing():
    pool = make_pool(mode="paged", page_size=4, kv_tokens=64)
    assert isinstance(pool.prefix, RadixCache)
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
    assert pool.slot_table[row2, :8].tolist() == slots[:8]
    assert kv2.out_cache_loc.tolist()[0] not in slots[:8]  # never writes a shared page
    stats = pool.stats()
    assert stats["prefix_cached_tokens"] == 8 and stats["prefix_hit_rate"] > 0
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
    alloc = pool.allocator.page_allocator
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
    assert pool.k_buffer.shape == pool.v_buffer.shape == (2, 17, 2, 4)
    assert pool.scratch_slot == 16
    assert pool.k_buffer.dtype == torch.float32


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
