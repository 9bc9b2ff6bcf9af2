"""Triton attention backend: KV store, paged split-KV decode and ragged prefill/extend.

The default on CUDA for fp16/bf16/fp32 and head sizes up to 256. On CPU tensors it runs
only under `TRITON_INTERPRET=1` and only when selected explicitly (`ASTR_BACKEND=triton`),
so that the whole engine's Triton path can be tested on a machine without a GPU.
"""

from __future__ import annotations

import torch

from astrai.extension import ops
from astrai.extension.backend.base import AttentionBackend
from astrai.extension.kv_cache import KVCache

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_HEAD_DIM = 256


class TritonBackend(AttentionBackend):
    """Triton kernels from `astrai.extension.ops` (the page table is `req_to_token`)."""

    name = "triton"
    takes_window = True
    takes_sinks = True

    def __init__(self, num_splits: int = 4) -> None:
        self.num_splits = num_splits

    def supports(self, q: torch.Tensor, kv_cache: KVCache) -> str | None:
        if q.dtype not in _DTYPES:
            return f"dtype {q.dtype} is not one of fp16, bf16, fp32"
        if kv_cache.k_buffer.dtype != q.dtype:
            return f"KV cache dtype {kv_cache.k_buffer.dtype} differs from the query's {q.dtype}"
        if q.shape[-1] > MAX_HEAD_DIM:
            return f"head_dim {q.shape[-1]} exceeds {MAX_HEAD_DIM}"
        return ops.unusable(q, kv_cache.k_buffer)

    def auto_reason(self, q: torch.Tensor, kv_cache: KVCache) -> str | None:
        if q.device.type != "cuda":
            return "not a CUDA tensor (the Triton interpreter is used only when selected)"
        return self.supports(q, kv_cache)

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: KVCache,
        layer_id: int,
        scale: float,
        window: int | None = None,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """As every backend's, plus `window` (a sliding-window layer's; None: full) and
        `sinks` (`[n_heads]` sink logits, or None)."""
        k_buf, v_buf = kv_cache.k_buffer[layer_id], kv_cache.v_buffer[layer_id]
        ops.store_kv(k, v, k_buf, v_buf, kv_cache.out_cache_loc)
        if kv_cache.is_decode:
            n = q.shape[0]
            ws_ok = (
                kv_cache.partial_out is not None
                and kv_cache.partial_out.shape[2] == self.num_splits
            )
            return ops.decode_attention(
                q,
                k_buf,
                v_buf,
                kv_cache.req_to_token,
                kv_cache.req_pool_indices,
                kv_cache.seq_lens,
                scale,
                num_splits=self.num_splits,
                out=kv_cache.attn_out[:n] if kv_cache.attn_out is not None else None,
                partial_out=kv_cache.partial_out[:n] if ws_ok else None,
                partial_lse=kv_cache.partial_lse[:n] if ws_ok else None,
                window=window,
                sinks=sinks,
            )
        return ops.extend_attention(
            q,
            k_buf,
            v_buf,
            kv_cache.req_to_token,
            kv_cache.req_pool_indices,
            kv_cache.seq_lens,
            kv_cache.qo_indptr,
            kv_cache.max_q_len,
            scale,
            window=window,
            sinks=sinks,
        )
