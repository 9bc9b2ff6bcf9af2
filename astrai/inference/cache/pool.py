"""KV storage, the request-to-token table, and `PagePool`, which ties them to an allocator
(the cache mode) and a prefix cache, and builds one `KVCache` per eager forward."""

from __future__ import annotations

import logging
from typing import Any, Literal

import torch

from astrai.extension import KVCache
from astrai.inference.cache.allocator import ContiguousAllocator, KVAllocator, PagedAllocator
from astrai.inference.cache.radix import NoPrefixCache, PrefixCache, RadixCache

logger = logging.getLogger(__name__)


class KVStorage:
    """`k_buffer` / `v_buffer` of shape `[n_layers, size + 1, n_kv_heads, head_dim]`.

    The extra last slot is scratch: padded batch rows (CUDA-graph decode) write there, so
    they never touch a real token's KV.

    `head_major=True` stores each head's slots together (`[n_layers, n_kv_heads, size + 1,
    head_dim]` in memory, the same shape through a transposed view). The CPU attention then
    streams one head's keys contiguously from a request's row, about 25% faster than over
    token-major rows on the benchmark machine.

    `v_head_dim=0` (MLA) leaves `v_buffer` zero-width: the one vector per token in `k_buffer`
    (the latent plus the rotary key) serves as both key and value.

    An int8 `dtype` (`kv_cache_dtype="int8"`) adds `k_scale` / `v_scale`, one fp32 scale per
    layer, slot and KV head (`[n_layers, size + 1, n_kv_heads]`); otherwise they are None.
    """

    def __init__(
        self,
        num_layers: int,
        size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
        head_major: bool = False,
        v_head_dim: int | None = None,
    ) -> None:
        v_dim = head_dim if v_head_dim is None else v_head_dim
        self.size = size
        self.scratch_slot = size
        self.head_major = head_major
        if head_major:
            shape = (num_layers, num_kv_heads, size + 1, head_dim)
            v_shape = (*shape[:-1], v_dim)
            self.k_buffer = torch.zeros(shape, dtype=dtype, device=device).transpose(1, 2)
            self.v_buffer = torch.zeros(v_shape, dtype=dtype, device=device).transpose(1, 2)
        else:
            shape = (num_layers, size + 1, num_kv_heads, head_dim)
            v_shape = (*shape[:-1], v_dim)
            self.k_buffer = torch.zeros(shape, dtype=dtype, device=device)
            self.v_buffer = torch.zeros(v_shape, dtype=dtype, device=device)
        self.k_scale: torch.Tensor | None = None
        self.v_scale: torch.Tensor | None = None
        if dtype == torch.int8:
            scale_shape = (num_layers, size + 1, num_kv_heads)
            self.k_scale = torch.zeros(scale_shape, dtype=torch.float32, device=device)
            self.v_scale = torch.zeros(scale_shape, dtype=torch.float32, device=device)
        # each buffer's storage size: what `restore` allocates again after a `release`
        self.nbytes = tuple(b.untyped_storage().nbytes() for b in self.buffers)

    @property
    def buffers(self) -> tuple[torch.Tensor, ...]:
        """K and V, and an int8 cache's scales."""
        scales = (
            () if self.k_scale is None or self.v_scale is None else (self.k_scale, self.v_scale)
        )
        return (self.k_buffer, self.v_buffer, *scales)

    @property
    def allocated_bytes(self) -> int:
        """Bytes `k_buffer` and `v_buffer` (and scales) hold now (0 while released)."""
        return sum(b.untyped_storage().nbytes() for b in self.buffers)

    def release(self) -> int:
        """Free both buffers' memory, keeping the tensors (their shapes, views and every
        reference to them): the storages shrink to nothing, as FSDP frees a gathered
        parameter. Returns the bytes freed. Reading the KV before `restore` is an error."""
        freed = self.allocated_bytes
        for buffer in self.buffers:
            buffer.untyped_storage().resize_(0)
        return freed

    def restore(self) -> None:
        """Allocate the buffers again, zeroed, as a fresh pool's (`release` undone). On a GPU
        the new memory may sit at other addresses: captured graphs must be captured again."""
        for buffer, nbytes in zip(self.buffers, self.nbytes):
            storage = buffer.untyped_storage()
            if storage.nbytes() != nbytes:
                storage.resize_(nbytes)
                with torch.no_grad():
                    buffer.zero_()

    @staticmethod
    def bytes_per_token(
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        v_head_dim: int | None = None,
    ) -> int:
        width = head_dim + (head_dim if v_head_dim is None else v_head_dim)
        if dtype == torch.int8:  # one byte per element, and an fp32 scale for K and for V
            return num_layers * num_kv_heads * (width + 2 * 4)
        return num_layers * num_kv_heads * width * torch.finfo(dtype).bits // 8


class ReqToTokenPool:
    """Rows of `req_to_token[num_reqs, max_ctx_len]`: position -> physical KV slot."""

    def __init__(self, num_reqs: int, max_ctx_len: int, device: torch.device) -> None:
        self.req_to_token = torch.zeros((num_reqs, max_ctx_len), dtype=torch.int32, device=device)
        self._free = list(range(num_reqs - 1, -1, -1))
        self.num_reqs = num_reqs
        self.max_ctx_len = max_ctx_len

    @property
    def num_free(self) -> int:
        return len(self._free)

    def alloc(self) -> int | None:
        return self._free.pop() if self._free else None

    def free(self, row: int) -> None:
        self._free.append(row)


def available_memory(device: torch.device) -> int:
    """Free bytes on `device` (CUDA: driver free memory; CPU: MemAvailable)."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    raise RuntimeError("cannot determine free memory; give the KV budget in tokens (kv_tokens)")


class PagePool:
    """The KV cache system: storage + request table + allocator + prefix cache.

    `contiguous` (default): each request row owns `max_seq_len` fixed slots; no dynamic
    allocation, no prefix sharing. `paged`: a shared pool of pages of `page_size` tokens,
    allocated on demand, with ref counts, LRU eviction and (by default when
    `page_size > 1`) radix prefix sharing. The paged budget is `kv_tokens`, or
    `memory_fraction` of the device's free memory. The mode is chosen once, here: it picks
    the `KVAllocator` and the `PrefixCache`, and nothing below branches on it.
    `head_major` picks the storage layout (see `KVStorage`); the default is head-major for
    contiguous rows on the CPU, which the CPU attention reads in place, and token-major
    otherwise (paged KV is gathered, and gathering whole token rows is faster).
    `latent_dim` (MLA) stores one vector of that width per token and layer instead of K and
    V per kv head (`num_kv_heads` / `head_dim` are then ignored); `bytes_per_token` is the
    per-token KV size either way. `window` (every layer's sliding window, the largest; None
    if a layer attends fully): a paged row gives back the pages its window left behind as
    it decodes (`release_unread`, allocator.py).
    """

    def __init__(
        self,
        *,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
        max_batch_size: int = 32,
        max_seq_len: int = 2048,
        mode: Literal["contiguous", "paged"] = "contiguous",
        page_size: int = 16,
        kv_tokens: int | None = None,
        memory_fraction: float | None = None,
        enable_radix: bool | None = None,
        head_major: bool | None = None,
        latent_dim: int | None = None,
        window: int | None = None,
    ) -> None:
        if mode not in ("contiguous", "paged"):
            raise ValueError(f"cache mode must be 'contiguous' or 'paged', got {mode!r}")
        if max_batch_size <= 0 or max_seq_len <= 0:
            raise ValueError("max_batch_size and max_seq_len must be positive")
        if mode == "paged" and page_size <= 0:
            raise ValueError(f"page_size must be positive, got {page_size}")
        device = torch.device(device)
        self.mode = mode
        self.device = device
        self.max_seq_len = max_seq_len
        v_head_dim = None
        if latent_dim is not None:  # MLA: one latent vector per token, no separate V
            num_kv_heads, head_dim, v_head_dim = 1, latent_dim, 0
        per_token = KVStorage.bytes_per_token(num_layers, num_kv_heads, head_dim, dtype, v_head_dim)
        self.bytes_per_token = per_token
        if mode == "contiguous":
            size = max_batch_size * max_seq_len
        else:
            size = _paged_size(
                kv_tokens,
                memory_fraction,
                page_size,
                max_batch_size * max_seq_len,
                per_token,
                device,
            )
        if head_major is None:  # CPU contiguous rows are read in place: head-major is faster
            head_major = device.type == "cpu" and mode == "contiguous"
        self.storage = KVStorage(
            num_layers,
            size,
            num_kv_heads,
            head_dim,
            dtype,
            device,
            head_major=head_major,
            v_head_dim=v_head_dim,
        )
        self.req_pool = ReqToTokenPool(max_batch_size, max_seq_len, device)
        table = self.req_pool.req_to_token
        self.allocator: KVAllocator
        self.prefix: PrefixCache = NoPrefixCache()
        if mode == "contiguous":
            self.allocator = ContiguousAllocator(table)
        else:
            paged = PagedAllocator(table, size // page_size, page_size, window)
            self.allocator = paged
            if enable_radix if enable_radix is not None else page_size > 1:
                self.prefix = RadixCache(paged.page_allocator, page_size)
        self.page_size = self.allocator.page_size
        self._peak_used_tokens = 0
        logger.info(
            "KV cache: %s, %d tokens (%.1f MiB), page_size=%d, prefix cache=%s",
            mode,
            size,
            size * per_token / 2**20,
            self.page_size,
            type(self.prefix).__name__,
        )

    # ------------------------------------------------------------------ views
    @property
    def max_batch_size(self) -> int:
        """Request rows: how many requests can hold KV at once."""
        return self.req_pool.num_reqs

    @property
    def slot_table(self) -> torch.Tensor:
        """`[max_batch_size, max_seq_len]` int32: request row, position -> physical KV slot."""
        return self.req_pool.req_to_token

    @property
    def scratch_slot(self) -> int:
        """A KV slot no request owns: padded batch rows write there."""
        return self.storage.scratch_slot

    @property
    def k_buffer(self) -> torch.Tensor:
        return self.storage.k_buffer

    @property
    def v_buffer(self) -> torch.Tensor:
        return self.storage.v_buffer

    # ------------------------------------------------------------------ capacity
    @property
    def capacity_tokens(self) -> int:
        return self.storage.size

    @property
    def used_tokens(self) -> int:
        return self.allocator.used_tokens

    @property
    def peak_used_tokens(self) -> int:
        """The most KV slots requests held at once since the last `reset_peak_used_tokens`
        (a high-water mark, as `torch.cuda.max_memory_allocated`: polling misses short peaks)."""
        return self._peak_used_tokens

    def reset_peak_used_tokens(self) -> None:
        self._peak_used_tokens = self.used_tokens

    @property
    def cached_tokens(self) -> int:
        return self.prefix.cached_tokens

    @property
    def shares_prefixes(self) -> bool:
        """A prefix cache is on: requests with a common prompt prefix can share its KV."""
        return not isinstance(self.prefix, NoPrefixCache)

    def all_free(self) -> bool:
        """True when no request holds any KV (prefix-cached pages count as reclaimable)."""
        return self.req_pool.num_free == self.req_pool.num_reqs and self.allocator.holds_nothing()

    def can_hold(self, num_tokens: int, reserve_pages: int = 0) -> bool:
        """Could a new request of `num_tokens` be admitted now, keeping `reserve_pages` spare?"""
        if num_tokens > self.max_seq_len or self.req_pool.num_free == 0:
            return False
        return self.allocator.can_hold(num_tokens, reserve_pages)

    # ------------------------------------------------------------------ per-request lifecycle
    def alloc_task(
        self, token_ids: list[int], limit: int | None = None, namespace: int | None = None
    ) -> tuple[int, int] | None:
        """A request row plus the number of leading tokens whose KV is already cached.

        `limit` caps that number (a request scoring its prompt from position s must compute
        the logits of position s - 1 on: limit s - 1). `namespace`: the request's LoRA
        adapter id (None: the base), whose KV only its own requests share.
        """
        row = self.req_pool.alloc()
        if row is None:
            return None
        end = self._matchable(len(token_ids), limit)
        shared = self.prefix.match(token_ids[:end], namespace) if end >= 1 else []
        self.allocator.open(row, shared)
        self._note_peak()
        return row, len(shared) * self.page_size

    def shareable_tokens(self, num_tokens: int, limit: int | None = None) -> int:
        """Leading tokens of a `num_tokens` prompt a later request could reuse once its KV is
        cached (`alloc_task`'s rule, whole pages); 0 without a prefix cache."""
        if not self.shares_prefixes:
            return 0
        return max(self._matchable(num_tokens, limit), 0) // self.page_size * self.page_size

    @staticmethod
    def _matchable(num_tokens: int, limit: int | None) -> int:
        # All but the last token, so at least one prompt token is computed and no request
        # ever writes into a shared page (matches are whole pages).
        return num_tokens - 1 if limit is None else min(num_tokens - 1, limit)

    def ensure(self, row: int, length: int) -> bool:
        """Back positions `[0, length)` of `row` with KV slots; False if memory ran out."""
        backed = length <= self.max_seq_len and self.allocator.ensure(row, length)
        self._note_peak()
        return backed

    def _note_peak(self) -> None:
        self._peak_used_tokens = max(self._peak_used_tokens, self.allocator.used_tokens)

    def release_unread(self, row: int, length: int) -> None:
        """`row` is `length` long, its next query at `length - 1`: the pages no query will
        read again go back (sliding-window models, paged rows; otherwise nothing)."""
        self.allocator.release_unread(row, length)

    def arrange_rows(self, rows: list[int], prompt_lens: list[int]) -> list[int]:
        """The rows for one admission's requests (the allocator's placement policy)."""
        return self.allocator.arrange(rows, prompt_lens)

    def cache_task(self, row: int, token_ids: list[int], namespace: int | None = None) -> None:
        """Index the complete pages of `token_ids` (tokens whose KV is materialised).

        Called when a prefill completes (the row keeps its references: a group's followers
        then find the prompt's pages) and again when the row is released, over the longer
        sequence: pages already in the tree are walked past, the new ones added. A page a
        row references is never evicted (the LRU holds only unreferenced pages); when an
        ancestor is evicted, a referenced descendant merely leaves the index."""
        self.prefix.insert(token_ids, self.allocator.pages(row), namespace)

    def free_task(self, row: int) -> None:
        self.allocator.free(row)
        self.req_pool.free(row)

    def invalidate_prefix_cache(self) -> None:
        self.prefix.reset()

    # ------------------------------------------------------------------ sleep
    @property
    def kv_allocated_bytes(self) -> int:
        """Bytes the KV storage holds now: its full size, or 0 while released."""
        return self.storage.allocated_bytes

    @property
    def released(self) -> bool:
        return self.kv_allocated_bytes < sum(self.storage.nbytes)

    def release(self) -> int:
        """Free the KV storage (the engine's sleep): the prefix cache forgets its pages,
        whose contents die with it; no request may hold KV. Returns the bytes freed."""
        self.prefix.reset()
        if not self.all_free():
            raise RuntimeError(
                "cannot release the KV pool while requests hold KV; let them finish first"
            )
        return self.storage.release()

    def close(self) -> int:
        """Free the KV storage for good (the engine's shutdown, which cancelled every request
        still holding KV: nothing reads it again), so an engine built next finds the memory
        free. Returns the bytes freed."""
        self.prefix.reset()
        return self.storage.release()

    def resume(self) -> None:
        """Allocate the KV storage again (zeroed, the same size): the pool of a fresh start,
        with an empty prefix cache."""
        self.storage.restore()

    # ------------------------------------------------------------------ per-step view
    def bind_tasks(self, rows: list[int], seq_lens: list[int], q_lens: list[int]) -> KVCache:
        """The `KVCache` for one forward: request `i` writes its last `q_lens[i]` positions."""
        device = self.device
        row_t = torch.tensor(rows, dtype=torch.int64)
        q_t = torch.tensor(q_lens, dtype=torch.int64)
        seq_t = torch.tensor(seq_lens, dtype=torch.int64)
        token_rows = torch.repeat_interleave(row_t, q_t)
        offsets = torch.arange(int(q_t.sum())) - torch.repeat_interleave(q_t.cumsum(0) - q_t, q_t)
        token_pos = torch.repeat_interleave(seq_t - q_t, q_t) + offsets
        zero = torch.zeros(1, dtype=torch.int64)
        table = self.req_pool.req_to_token
        if device.type == "cpu":
            out_loc = table[token_rows, token_pos].to(torch.int64)
        else:
            out_loc = table[token_rows.to(device), token_pos.to(device)].to(torch.int64)
        return KVCache(
            k_buffer=self.storage.k_buffer,
            v_buffer=self.storage.v_buffer,
            req_to_token=table,
            req_pool_indices=row_t.to(device),
            seq_lens=seq_t.to(torch.int32).to(device),
            out_cache_loc=out_loc,
            kv_indptr=torch.cat([zero, seq_t.cumsum(0)]).to(torch.int32).to(device),
            qo_indptr=torch.cat([zero, q_t.cumsum(0)]).to(torch.int32).to(device),
            max_len=max(seq_lens),
            max_q_len=max(q_lens),
            seq_lens_host=tuple(seq_lens),
            q_lens_host=tuple(q_lens),
            req_pool_indices_host=tuple(rows),
            row_stride=self.allocator.row_stride,
            k_scale=self.storage.k_scale,
            v_scale=self.storage.v_scale,
        )

    def stats(self) -> dict[str, Any]:
        return {
            "cache_mode": self.mode,
            "page_size": self.page_size,
            "kv_capacity_tokens": self.capacity_tokens,
            "kv_used_tokens": self.used_tokens,
            "kv_usage": self.used_tokens / max(self.capacity_tokens, 1),
            "kv_allocated_bytes": self.kv_allocated_bytes,
            **self.prefix.stats(),
        }


def _paged_size(
    kv_tokens: int | None,
    memory_fraction: float | None,
    page_size: int,
    default: int,
    per_token: int,
    device: torch.device,
) -> int:
    """Token slots of a paged pool: `kv_tokens`, or a fraction of free memory, in whole pages."""
    if kv_tokens is None and memory_fraction is not None:
        if not 0 < memory_fraction <= 1:
            raise ValueError(f"memory_fraction must be in (0, 1], got {memory_fraction}")
        kv_tokens = int(available_memory(device) * memory_fraction) // per_token
    if kv_tokens is None:
        kv_tokens = default
    if kv_tokens < page_size:
        raise ValueError(f"kv_tokens={kv_tokens} is smaller than one page ({page_size})")
    return kv_tokens // page_size * page_size
