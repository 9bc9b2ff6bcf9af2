"""Attention with sinks (GPT-OSS): a learned logit per head joins each softmax's denominator.

The sink is one more column of the scores that no value stands behind, so it only takes
probability mass away from the keys: ``out = sum_j p_j v_j`` with ``p = softmax([scores,
sink])[:-1]`` (transformers' ``eager_attention_forward`` of GPT-OSS). No fused kernel here
takes such a column, so the training forward (`astrai.model.documents`) computes it in plain
torch, as does the engine (per request as `windowed.py` does, with or without a window)
wherever its backend's kernels take no sinks (`AttentionBackend.takes_sinks`: the compiled
CPU kernel and the Triton kernels do); the softmax runs in fp32.
"""

from __future__ import annotations

import torch

from astrai.extension.backend.base import write_kv
from astrai.extension.backend.windowed import request_kv, window_keys_mask
from astrai.extension.kv_cache import KVCache


def sink_softmax_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor,
    scale: float,
    sinks: torch.Tensor,
) -> torch.Tensor:
    """``q`` `[B, heads, Q, D]`, ``k, v`` `[B, kv_heads, K, D]` (grouped heads share them),
    boolean ``mask`` broadcastable to `[B, heads, Q, K]` (True: attend), ``sinks`` `[heads]`;
    returns `[B, heads, Q, D]`."""
    groups = q.shape[1] // k.shape[1]
    if groups > 1:
        k = k.repeat_interleave(groups, dim=1)
        v = v.repeat_interleave(groups, dim=1)
    scores = torch.matmul(q, k.transpose(-1, -2)).float() * scale
    scores = scores.masked_fill(~mask, float("-inf"))
    sink = sinks.float().view(1, -1, 1, 1).expand(*scores.shape[:-1], 1)
    probs = torch.cat([scores, sink], dim=-1).softmax(-1)[..., :-1]
    return torch.matmul(probs.to(v.dtype), v)


def sink_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: KVCache,
    layer_id: int,
    scale: float,
    window: int | None,
    sinks: torch.Tensor,
) -> torch.Tensor:
    """Write this step's K/V, then attend each request over its cached keys (only the last
    `window` of them for a sliding-window layer) with the sinks in the denominator."""
    write_kv(k, v, kv_cache, layer_id)
    out = torch.empty_like(q)
    for span in kv_cache.request_spans():
        _, start, q_len, _ = span
        out[start : start + q_len] = sink_span(q, kv_cache, layer_id, scale, window, sinks, span)
    return out


def sink_span(
    q: torch.Tensor,
    kv_cache: KVCache,
    layer_id: int,
    scale: float,
    window: int | None,
    sinks: torch.Tensor,
    span: tuple[int, int, int, int],
) -> torch.Tensor:
    """`[q_len, heads, head_dim]` attention with sinks of one request span `(request, start,
    q_len, kv_len)` over its cached keys (K/V already written)."""
    i, start, q_len, kv_len = span
    first = 0 if window is None else max(0, kv_len - q_len - window + 1)
    keys, values = request_kv(kv_cache, layer_id, i, first, kv_len)
    mask = window_keys_mask(q_len, kv_len, first, kv_len if window is None else window, q.device)
    o = sink_softmax_attention(
        q[start : start + q_len].transpose(0, 1)[None],
        keys.to(q.dtype).transpose(0, 1)[None],
        values.to(q.dtype).transpose(0, 1)[None],
        mask,
        scale,
        sinks,
    )
    return o[0].transpose(0, 1)
