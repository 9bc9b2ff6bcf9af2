"""Optional flash-attn backend: used when the `flash_attn` package is installed.

flash-attn's own paged path needs large pages, while our page table maps single token
slots, so this backend gathers each request's K/V into one packed tensor and calls
`flash_attn_varlen_func`, whose causal mask is bottom-right aligned (query j of a request
with q_len n and kv length L sees keys 0..L-n+j), exactly the semantics we need.
"""

from __future__ import annotations

import functools
from types import ModuleType

import torch

from astrai.extension.backend.base import AttentionBackend, BackendUnavailable, write_kv
from astrai.extension.kv_cache import KVCache

_DTYPES = (torch.float16, torch.bfloat16)


@functools.cache
def _flash_attn() -> ModuleType | str:
    """The imported module, or the reason it cannot be imported (checked once per process)."""
    try:
        import flash_attn
    except Exception as exc:  # ImportError, or a broken build raising at import time
        return f"flash_attn is not importable ({type(exc).__name__}: {exc})"
    return flash_attn


class FlashAttnBackend(AttentionBackend):
    """flash-attn varlen kernels over gathered K/V; CUDA fp16/bf16 only."""

    name = "flash"
    takes_window = True

    def supports(self, q: torch.Tensor, kv_cache: KVCache) -> str | None:
        module = _flash_attn()
        if isinstance(module, str):
            return module
        if not q.is_cuda:
            return f"needs CUDA tensors, got {q.device.type}"
        if q.dtype not in _DTYPES or kv_cache.k_buffer.dtype != q.dtype:
            return f"needs fp16/bf16 query and cache of one dtype, got {q.dtype} and {kv_cache.k_buffer.dtype}"
        if q.shape[-1] > 256 or q.shape[-1] % 8:
            return f"head_dim {q.shape[-1]} unsupported (needs a multiple of 8, at most 256)"
        return None

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: KVCache,
        layer_id: int,
        scale: float,
        window: int | None = None,
    ) -> torch.Tensor:
        """As every backend's, plus `window`: flash-attn's own `window_size=(window - 1, 0)`
        (keys p - window < t <= p, bottom-right aligned as its causal mask)."""
        module = _flash_attn()
        if isinstance(module, str):
            raise BackendUnavailable(f"attention backend 'flash': {module}")
        write_kv(k, v, kv_cache, layer_id)
        rows = kv_cache.req_to_token[kv_cache.req_pool_indices, : kv_cache.max_len]
        slots = torch.cat([rows[i, :n] for i, n in enumerate(kv_cache.seq_lens_host)])
        return module.flash_attn_varlen_func(
            q,
            kv_cache.k_buffer[layer_id][slots],
            kv_cache.v_buffer[layer_id][slots],
            cu_seqlens_q=kv_cache.qo_indptr,
            cu_seqlens_k=kv_cache.kv_indptr,
            max_seqlen_q=kv_cache.max_q_len,
            max_seqlen_k=kv_cache.max_len,
            softmax_scale=scale,
            causal=True,
            window_size=(-1, -1) if window is None else (window - 1, 0),
        )
