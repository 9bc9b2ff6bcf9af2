"""The per-step view of the KV cache that attention backends read and write.

Plain data, no methods: the inference model runner builds one per forward step
(`PagePool.bind_tasks()`, or the decode workspace at fixed addresses), the model passes it
through to `astrai.extension.attention`.
Tokens of a step are packed: request `i` owns query rows `qo_indptr[i]:qo_indptr[i+1]`,
and its keys/values after the write are the slots
`req_to_token[req_pool_indices[i], :seq_lens[i]]` of `k_buffer[layer]` / `v_buffer[layer]`.
"""

from __future__ import annotations

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
    # Backend scratch for this step: what a backend derives from the host-side lengths on
    # the first layer (e.g. the CPU decode's row segments) and reuses on the others.
    plan: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

    @property
    def batch_size(self) -> int:
        return len(self.seq_lens_host)

    @property
    def is_decode(self) -> bool:
        return self.max_q_len == 1
