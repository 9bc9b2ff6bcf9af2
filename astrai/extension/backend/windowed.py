"""Sliding-window attention over the KV cache (Mistral, Qwen2 `use_sliding_window`, ...).

A windowed layer's query at position ``p`` sees keys ``p - window < j <= p`` (transformers'
meaning). Each request reads only the cache rows of its window, ``[kv_len - q_len - window
+ 1, kv_len)``: pages before it are never read (they stay allocated; see
docs/inference.md, "Sliding-window models"). One SDPA call per request, on any device and
floating dtype, with an int8 cache dequantized. `selection.attention` sends a windowed
layer here once some request's keys outgrow the window (unless the compiled CPU kernel,
which takes the window itself, serves the call); until then the window changes nothing and
the usual backend serves.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from astrai.extension.backend.base import write_kv
from astrai.extension.kv_cache import KVCache


def window_rows(
    kv_cache: KVCache, buf: torch.Tensor, request: int, first: int, kv_len: int
) -> torch.Tensor:
    """Cache rows ``[first, kv_len)`` of `request` in `buf`: a slice in contiguous mode, else
    gathered through the page table (only the window's slots)."""
    if kv_cache.row_stride is not None and kv_cache.req_pool_indices_host:
        base = kv_cache.req_pool_indices_host[request] * kv_cache.row_stride
        return buf[base + first : base + kv_len]
    slots = kv_cache.req_to_token[kv_cache.req_pool_indices[request], first:kv_len]
    return buf.index_select(0, slots.to(torch.int64))


def request_kv(
    kv_cache: KVCache, layer_id: int, request: int, first: int, kv_len: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values of `request`'s cache rows ``[first, kv_len)`` in layer `layer_id`
    (`[rows, kv_heads, head_dim]`; an int8 cache dequantized to fp32)."""
    keys = window_rows(kv_cache, kv_cache.k_buffer[layer_id], request, first, kv_len)
    values = window_rows(kv_cache, kv_cache.v_buffer[layer_id], request, first, kv_len)
    if kv_cache.k_scale is not None and kv_cache.v_scale is not None:  # int8: dequantize
        k_scale = window_rows(kv_cache, kv_cache.k_scale[layer_id], request, first, kv_len)
        v_scale = window_rows(kv_cache, kv_cache.v_scale[layer_id], request, first, kv_len)
        keys, values = keys.float() * k_scale[..., None], values.float() * v_scale[..., None]
    return keys, values


def window_keys_mask(
    q_len: int, kv_len: int, first: int, window: int, device: torch.device
) -> torch.Tensor:
    """``[q_len, kv_len - first]`` boolean: query ``j`` (position ``kv_len - q_len + j``) sees
    key ``t`` (position ``first + t``) when ``0 <= position difference < window``."""
    pos_q = torch.arange(kv_len - q_len, kv_len, device=device)[:, None]
    pos_k = torch.arange(first, kv_len, device=device)[None, :]
    diff = pos_q - pos_k
    return (diff >= 0) & (diff < window)


def windowed_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: KVCache,
    layer_id: int,
    scale: float,
    window: int,
) -> torch.Tensor:
    """Write this step's K/V, then attend each request over its window only."""
    write_kv(k, v, kv_cache, layer_id)
    out = torch.empty_like(q)
    for span in kv_cache.request_spans():
        _, start, q_len, _ = span
        out[start : start + q_len] = window_span(q, kv_cache, layer_id, scale, window, span)
    return out


def window_span(
    q: torch.Tensor,
    kv_cache: KVCache,
    layer_id: int,
    scale: float,
    window: int,
    span: tuple[int, int, int, int],
) -> torch.Tensor:
    """`[q_len, heads, head_dim]` attention of one request span `(request, start, q_len,
    kv_len)` over its window's cache rows (K/V already written)."""
    i, start, q_len, kv_len = span
    n_kv_heads = kv_cache.k_buffer.shape[-2]
    first = max(0, kv_len - q_len - window + 1)
    keys, values = request_kv(kv_cache, layer_id, i, first, kv_len)
    mask = window_keys_mask(q_len, kv_len, first, window, q.device)
    o = F.scaled_dot_product_attention(
        q[start : start + q_len].transpose(0, 1)[None],
        keys.to(q.dtype).transpose(0, 1)[None],
        values.to(q.dtype).transpose(0, 1)[None],
        attn_mask=mask,
        scale=scale,
        enable_gqa=q.shape[1] != n_kv_heads,
    )
    return o[0].transpose(0, 1)
