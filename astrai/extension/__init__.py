"""Attention for inference: one policy entry point over interchangeable backends.

`attention(q, k, v, kv_cache, layer_id, scale=...)` writes the step's K/V into the paged
cache and attends. Backends: triton (default on GPU; the kernels live in `ops/`), flash
(when flash-attn is installed), torch_native (SDPA; always available). Select one strictly with
`with attn_backend("torch_native"):` or `ASTR_BACKEND=...`; otherwise the first capable
backend serves each call. `linear` is the model's matmul (oneDNN for fp32 CPU inference).
`with batch_invariant():` makes products and torch_native attention batch-invariant
(`astrai.extension.invariance`).
"""

from astrai.extension.backend import (
    ATTN_BACKEND,
    AttentionBackend,
    BackendUnavailable,
    apply_rotary_emb,
    apply_rotary_qk,
    attention,
    attn_backend,
    get_backend,
    selected_backend,
)
from astrai.extension.invariance import batch_invariant, batch_invariant_enabled, invariant_rows
from astrai.extension.kv_cache import KVCache
from astrai.extension.linear import linear, onednn_linear_enabled

__all__ = [
    "ATTN_BACKEND",
    "AttentionBackend",
    "BackendUnavailable",
    "KVCache",
    "apply_rotary_emb",
    "apply_rotary_qk",
    "attention",
    "attn_backend",
    "batch_invariant",
    "batch_invariant_enabled",
    "get_backend",
    "invariant_rows",
    "linear",
    "onednn_linear_enabled",
    "selected_backend",
]
