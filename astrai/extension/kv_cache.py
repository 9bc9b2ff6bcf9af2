"""The per-step view of the KV cache that attention backends read and write.

Plain data, no methods: the inference model runner builds one per forward step
(`PagePool.bind_tasks()`, or the decode workspace at fixed addresses), the model passes it
through to `astrai.extension.attention`.
Tokens of a step are packed: request `i` owns query rows `qo_indptr[i]:qo_indptr[i+1]`,
and its keys/values after the write are the slots
`req_to_token[req_pool_indices[i], :seq_lens[i]]` of `k_buffer[layer]` / `v_buffer[layer]`.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class KVCache:
    k_buffer: torch.Tensor  # [n_layers, size, n_kv_heads, head_dim]
    v_buffer: torch.Tensor  # [n_layers, size, n_kv_heads, head_dim]
    req_to_token: torch.Tensor  # [num_reqs, max_ctx_len] int32: position -> physical slot
    req_pool_indices: torch.Tensor  # [batch] int64: row of req_to_token per request
    seq_lens: torch.Tensor  # [batch] int32: KV length per request after this step's write
    out_cache_loc: torch.Tensor  # [num_tokens] int64: slot each new token's K/V is written to
    kv_indptr: torch.Tensor  # [batch + 1] int32: prefix sum of seq_lens
    qo_indptr: torch.Tensor  # [batch + 1] int32: prefix sum of per-request new-token counts
    max_len: int  # max(seq_lens), known on the host so decode needs no device sync
    max_q_len: int  # max new tokens of one request (1 for a pure decode step)
    seq_lens_host: tuple[int, ...]  # host copies: the CPU path slices without syncing
    q_lens_host: tuple[int, ...]
    req_pool_indices_host: tuple[int, ...] = ()
    # Set when request row r owns the fixed slots `r * row_stride + position` (contiguous
    # mode): backends may then read K/V through a strided view instead of gathering.
    row_stride: int | None = None
    # Decode workspace buffers at fixed addresses (CUDA graphs); a backend that can write
    # its split-KV partials and output there does, instead of allocating.
    attn_out: torch.Tensor | None = None  # [>= batch, n_heads, head_dim]
    partial_out: torch.Tensor | None = None  # [>= batch, n_heads, splits, head_dim] fp32
    partial_lse: torch.Tensor | None = None  # [>= batch, n_heads, splits] fp32
    # An int8 cache's fp32 scales, one per (layer, slot, KV head), `[n_layers, size, n_kv_heads]`
    # (`kv_cache_dtype="int8"`); None for a cache in a floating dtype.
    k_scale: torch.Tensor | None = None
    v_scale: torch.Tensor | None = None
    # Backend scratch for this step: what a backend derives from the host-side lengths on
    # the first layer (e.g. the CPU decode's row segments) and reuses on the others.
    plan: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

    @property
    def batch_size(self) -> int:
        return len(self.seq_lens_host)

    @property
    def is_decode(self) -> bool:
        return self.max_q_len == 1

    def request_spans(self) -> Iterator[tuple[int, int, int, int]]:
        """``(request, first query row, q_len, kv_len)`` of each request with new tokens this
        step, from the host-side lengths (no device sync): the loops of the CPU paths that
        attend request by request."""
        start = 0
        for i, (q_len, kv_len) in enumerate(zip(self.q_lens_host, self.seq_lens_host)):
            if q_len == 0:
                continue
            if q_len > kv_len:
                raise ValueError(f"request {i}: q_len {q_len} exceeds its kv length {kv_len}")
            yield i, start, q_len, kv_len
            start += q_len

    def cached_rows(self, buf: torch.Tensor, request: int, kv_len: int) -> torch.Tensor:
        """The first ``kv_len`` cache rows of ``request`` in ``buf`` (one layer's buffer): a
        plain slice where requests own contiguous rows, else gathered through the page table."""
        if self.row_stride is not None and self.req_pool_indices_host:
            base = self.req_pool_indices_host[request] * self.row_stride
            return buf[base : base + kv_len]
        slots = self.req_to_token[self.req_pool_indices[request], :kv_len]
        return buf.index_select(0, slots.to(torch.int64))


def suffix_causal_mask(q_len: int, kv_len: int, device: torch.device) -> torch.Tensor:
    """``[q_len, kv_len]`` boolean: query ``j`` (at position ``kv_len - q_len + j``) sees the
    keys up to its own position."""
    return torch.ones(q_len, kv_len, dtype=torch.bool, device=device).tril(kv_len - q_len)
