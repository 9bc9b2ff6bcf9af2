"""Latent-space attention over an MLA KV cache (torch native; CPU and any GPU).

An MLA layer's cache (`kv_cache.k_buffer[layer]`, shape `[slots, 1, kv_lora_rank + rope]`)
holds one vector per token: the normed KV latent followed by the rotary key. With the
absorbed query `[q_nope @ W_UK, q_pe]` this is multi-query attention whose keys are those
vectors and whose values are their first `value_dim` (latent) entries, so nothing is
decompressed. `v_buffer` is unused (zero width) for MLA.

In batch-invariant mode (`astrai.extension.invariance`) every request attends alone over
exactly its own cached vectors, by a kernel its own query and key lengths choose.

Only this torch-native implementation exists (a Triton kernel may follow), so a strict
selection of another backend raises `BackendUnavailable` rather than switching silently.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from astrai.extension.backend import ATTN_BACKEND, BackendUnavailable, selected_backend
from astrai.extension.invariance import batch_invariant_enabled
from astrai.extension.kv_cache import KVCache, suffix_causal_mask


def latent_attention(
    q: torch.Tensor,
    latent: torch.Tensor,
    kv_cache: KVCache,
    layer_id: int,
    *,
    scale: float,
    value_dim: int,
) -> torch.Tensor:
    """Write this step's `latent [T, W]` at its slots and attend: `q [T, H, W]` -> `[T, H, value_dim]`."""
    choice = selected_backend()
    if choice is not None and choice != ATTN_BACKEND.TORCH_NATIVE:
        raise BackendUnavailable(
            f"attention backend {choice.value!r} is selected, but MLA's latent attention "
            "runs only in torch_native"
        )
    buf = kv_cache.k_buffer[layer_id]
    if buf.shape[-2] != 1 or buf.shape[-1] != latent.shape[-1]:
        raise ValueError(
            f"MLA cache layer {layer_id} has shape {tuple(buf.shape)}; expected "
            f"[slots, 1, {latent.shape[-1]}] (build the PagePool with latent_dim)"
        )
    buf[kv_cache.out_cache_loc] = latent.to(buf.dtype).unsqueeze(1)
    if q.shape[0] == 0:
        return q.new_empty(0, q.shape[1], value_dim)
    if batch_invariant_enabled():
        return _per_request(q, buf, kv_cache, scale, value_dim)
    if kv_cache.is_decode:
        return _decode(q, buf, kv_cache, scale, value_dim)
    return _extend(q, latent, buf, kv_cache, scale, value_dim)


def _decode(
    q: torch.Tensor, buf: torch.Tensor, kv_cache: KVCache, scale: float, value_dim: int
) -> torch.Tensor:
    """One padded batch: gather each request's vectors, mask keys past its length."""
    batch, max_len = q.shape[0], kv_cache.max_len
    rows = kv_cache.req_to_token[kv_cache.req_pool_indices, :max_len]
    valid = torch.arange(max_len, device=q.device) < kv_cache.seq_lens[:, None]
    slots = torch.where(valid, rows, 0).reshape(-1).to(torch.int64)
    keys = buf.index_select(0, slots).view(batch, 1, max_len, -1).to(q.dtype)
    out = F.scaled_dot_product_attention(
        q.unsqueeze(2),  # [B, H, 1, W]
        keys,
        keys[..., :value_dim],
        attn_mask=valid[:, None, None, :],
        scale=scale,
        enable_gqa=True,
    )
    return out.squeeze(2)


def _extend(
    q: torch.Tensor,
    latent: torch.Tensor,
    buf: torch.Tensor,
    kv_cache: KVCache,
    scale: float,
    value_dim: int,
) -> torch.Tensor:
    """Prefill / extend / mixed steps: one causal SDPA call per request (host-side lengths)."""
    out = q.new_empty(q.shape[0], q.shape[1], value_dim)
    for i, start, q_len, kv_len in kv_cache.request_spans():
        if q_len == kv_len:
            keys = latent[start : start + q_len]
        else:
            keys = kv_cache.cached_rows(buf, i, kv_len)[:, 0]
        keys = keys.to(q.dtype)[None, None]  # [1, 1, L, W]
        queries = q[start : start + q_len].transpose(0, 1)[None]  # [1, H, q_len, W]
        mask = None if q_len == kv_len else suffix_causal_mask(q_len, kv_len, q.device)
        o = F.scaled_dot_product_attention(
            queries,
            keys,
            keys[..., :value_dim],
            attn_mask=mask,
            is_causal=mask is None,
            scale=scale,
            enable_gqa=True,
        )
        out[start : start + q_len] = o[0].transpose(0, 1)
    return out


def _per_request(
    q: torch.Tensor, buf: torch.Tensor, kv_cache: KVCache, scale: float, value_dim: int
) -> torch.Tensor:
    """Batch-invariant: request by request over its vectors read back from the cache, one
    query token without a mask, several with the causal mask of their place."""
    out = q.new_empty(q.shape[0], q.shape[1], value_dim)
    for i, start, q_len, kv_len in kv_cache.request_spans():
        keys = kv_cache.cached_rows(buf, i, kv_len)[:, 0].to(q.dtype)[None, None]  # [1, 1, L, W]
        queries = q[start : start + q_len].transpose(0, 1)[None]  # [1, H, q_len, W]
        mask = None  # one query: every key; the whole sequence: the plain causal mask
        if 1 < q_len < kv_len:
            mask = suffix_causal_mask(q_len, kv_len, q.device)
        o = F.scaled_dot_product_attention(
            queries,
            keys,
            keys[..., :value_dim],
            attn_mask=mask,
            is_causal=1 < q_len == kv_len,
            scale=scale,
            enable_gqa=True,
        )
        out[start : start + q_len] = o[0].transpose(0, 1)
    return out
