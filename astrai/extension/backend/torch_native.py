"""SDPA over K/V gathered through the page table: the always-available (and CPU) backend.

Decode steps run as one padded batch (one gather, one SDPA call, a key-length mask) and
fold each GQA group into the query axis, so K/V are never expanded per query head. Prefill
and mixed steps loop over requests using the host-side lengths, so nothing here forces a
device sync.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from astrai.extension.backend.base import AttentionBackend, write_kv
from astrai.extension.kv_cache import KVCache


class TorchNativeBackend(AttentionBackend):
    """`F.scaled_dot_product_attention` on any device and any floating dtype."""

    name = "torch_native"

    def supports(self, q: torch.Tensor, kv_cache: KVCache) -> str | None:
        if not q.is_floating_point():
            return f"query dtype {q.dtype} is not a floating-point type"
        if q.dim() != 3:
            return f"query must be [num_tokens, n_heads, head_dim], got shape {tuple(q.shape)}"
        n_kv_heads, head_dim = kv_cache.k_buffer.shape[-2:]
        if q.shape[1] % n_kv_heads or q.shape[2] != head_dim:
            return (
                f"query heads/head_dim {tuple(q.shape[1:])} do not fit a cache of "
                f"{n_kv_heads} kv heads x {head_dim}"
            )
        return None

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: KVCache,
        layer_id: int,
        scale: float,
    ) -> torch.Tensor:
        write_kv(k, v, kv_cache, layer_id)
        if q.shape[0] == 0:
            return torch.empty_like(q)
        if kv_cache.is_decode:
            return self._decode(q, kv_cache, layer_id, scale)
        return self._extend(q, k, v, kv_cache, layer_id, scale)

    @staticmethod
    def _decode_strided(
        q: torch.Tensor, kv_cache: KVCache, layer_id: int, scale: float
    ) -> torch.Tensor:
        """Decode over contiguous rows: K/V are strided views of the buffers, never copied.

        Attention runs over every row up to the highest active one (idle rows get a zero
        query and one visible key, so nothing is NaN) and the active rows are picked after.
        """
        batch, n_heads, head_dim = q.shape
        n_kv_heads = kv_cache.k_buffer.shape[-2]
        stride, max_len = kv_cache.row_stride, kv_cache.max_len
        num_rows = max(kv_cache.req_pool_indices_host) + 1
        shape = (num_rows, stride, n_kv_heads, head_dim)
        keys = kv_cache.k_buffer[layer_id, : num_rows * stride].view(shape)[:, :max_len]
        values = kv_cache.v_buffer[layer_id, : num_rows * stride].view(shape)[:, :max_len]
        rows = kv_cache.req_pool_indices
        grouped = q.new_zeros(num_rows, n_kv_heads, n_heads // n_kv_heads, head_dim)
        grouped[rows] = q.reshape(batch, n_kv_heads, n_heads // n_kv_heads, head_dim)
        lens = torch.ones(num_rows, dtype=kv_cache.seq_lens.dtype, device=q.device)
        lens[rows] = kv_cache.seq_lens
        valid = torch.arange(max_len, device=q.device) < lens[:, None]
        out = F.scaled_dot_product_attention(
            grouped,
            keys.to(q.dtype).transpose(1, 2),
            values.to(q.dtype).transpose(1, 2),
            attn_mask=valid[:, None, None, :],
            scale=scale,
        )
        return out[rows].reshape(batch, n_heads, head_dim)

    @staticmethod
    def _decode(q: torch.Tensor, kv_cache: KVCache, layer_id: int, scale: float) -> torch.Tensor:
        rows_host = kv_cache.req_pool_indices_host
        # Worth it while the rows are dense; a sparse set of rows is cheaper to gather.
        if kv_cache.row_stride is not None and rows_host and max(rows_host) < 2 * len(rows_host):
            return TorchNativeBackend._decode_strided(q, kv_cache, layer_id, scale)
        batch, n_heads, head_dim = q.shape
        n_kv_heads = kv_cache.k_buffer.shape[-2]
        max_len = kv_cache.max_len
        rows = kv_cache.req_to_token[kv_cache.req_pool_indices, :max_len]
        valid = torch.arange(max_len, device=q.device) < kv_cache.seq_lens[:, None]
        # Table entries past a request's length may hold anything: point them at slot 0.
        slots = torch.where(valid, rows, 0)
        # index_select on the flattened slots is several times faster than advanced indexing.
        flat = slots.reshape(-1)
        shape = (batch, max_len, n_kv_heads, head_dim)
        keys = kv_cache.k_buffer[layer_id].index_select(0, flat).view(shape)
        values = kv_cache.v_buffer[layer_id].index_select(0, flat).view(shape)
        keys = keys.to(q.dtype).transpose(1, 2)  # [B, Hkv, L, D]
        values = values.to(q.dtype).transpose(1, 2)
        # One query per request: the heads sharing a kv head become that head's query rows.
        grouped = q.reshape(batch, n_kv_heads, n_heads // n_kv_heads, head_dim)
        out = F.scaled_dot_product_attention(
            grouped, keys, values, attn_mask=valid[:, None, None, :], scale=scale
        )
        return out.reshape(batch, n_heads, head_dim)

    @staticmethod
    def _extend(
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: KVCache,
        layer_id: int,
        scale: float,
    ) -> torch.Tensor:
        gqa = q.shape[1] != kv_cache.k_buffer.shape[-2]
        k_buf, v_buf = kv_cache.k_buffer[layer_id], kv_cache.v_buffer[layer_id]
        rows = kv_cache.req_to_token[kv_cache.req_pool_indices, : kv_cache.max_len]
        out = torch.empty_like(q)
        start = 0
        for i, (q_len, kv_len) in enumerate(zip(kv_cache.q_lens_host, kv_cache.seq_lens_host)):
            if q_len == 0:
                continue
            if q_len > kv_len:
                raise ValueError(f"request {i}: q_len {q_len} exceeds its kv length {kv_len}")
            if q_len == kv_len:  # nothing cached: this step's own K/V are the whole context
                keys, values = k[start : start + q_len], v[start : start + q_len]
            else:
                slots = rows[i, :kv_len]
                keys, values = k_buf.index_select(0, slots), v_buf.index_select(0, slots)
            # 4-D [1, heads, len, D]: CPU SDPA takes its fused kernel only for 4-D inputs.
            keys = keys.to(q.dtype).transpose(0, 1)[None]
            values = values.to(q.dtype).transpose(0, 1)[None]
            queries = q[start : start + q_len].transpose(0, 1)[None]
            if q_len == kv_len:  # whole sequence computed now: the plain causal mask
                mask, causal = None, True
            else:  # cached prefix: query j sits at position kv_len - q_len + j
                mask = torch.ones(q_len, kv_len, dtype=torch.bool, device=q.device)
                mask, causal = mask.tril(kv_len - q_len), False
            o = F.scaled_dot_product_attention(
                queries, keys, values, attn_mask=mask, is_causal=causal, scale=scale, enable_gqa=gqa
            )
            out[start : start + q_len] = o[0].transpose(0, 1)
            start += q_len
        return out
