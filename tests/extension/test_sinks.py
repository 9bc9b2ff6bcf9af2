"""Attention sinks (GPT-OSS) against a per-query reference written from the definition
(softmax over the visible keys' scores plus the head's sink logit, the sink's share dropped):
the training forward's causal, windowed, padded and packed-document paths, and the engine's
per-request path over a paged cache (a request whose prefix is already cached, with and
without a window) on torch_native, the CPU kernel and Triton; an explicit flash selection
refuses sinks, naming them."""

from __future__ import annotations

import pytest
import torch

from astrai.extension import KVCache, attn_backend
from astrai.extension.backend import selection
from astrai.extension.backend.base import BackendUnavailable
from astrai.extension.backend.selection import attention
from astrai.extension.backend.sinks import sink_attention
from astrai.extension.cpu_kernels import paged_attention_op
from astrai.model.documents import DocumentSpans, training_attention

HEADS, KV_HEADS, DIM = 4, 2, 8
SCALE = DIM**-0.5
NO_KERNEL = pytest.mark.skipif(
    paged_attention_op() is None, reason="the CPU kernel is not built (make setup)"
)


def reference(q, k, v, sinks, visible):
    """One query row at a time: `q` `[Q, H, D]`, `k, v` `[K, KV, D]`, `visible(i, j)` says
    whether query `i` sees key `j`; returns `[Q, H, D]`."""
    groups = q.shape[1] // k.shape[1]
    out = torch.zeros_like(q)
    for i in range(q.shape[0]):
        keys = [j for j in range(k.shape[0]) if visible(i, j)]
        for h in range(q.shape[1]):
            kh = k[keys, h // groups]
            scores = (kh @ q[i, h]) * SCALE
            weights = torch.cat([scores, sinks[h : h + 1]]).softmax(0)[:-1]
            out[i, h] = weights @ v[keys, h // groups]
    return out


def tensors(b: int, s: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, HEADS, s, DIM, generator=g)
    k = torch.randn(b, KV_HEADS, s, DIM, generator=g)
    v = torch.randn(b, KV_HEADS, s, DIM, generator=g)
    sinks = torch.randn(HEADS, generator=g) * 2
    return q, k, v, sinks


def rows(x: torch.Tensor, b: int) -> torch.Tensor:
    return x[b].transpose(0, 1)  # [heads, S, D] -> [S, heads, D]


@pytest.mark.parametrize("window", [None, 4])
def test_training_causal_and_windowed_attention_with_sinks(window):
    q, k, v, sinks = tensors(2, 11)
    got = training_attention(
        q, k, v, None, scale=SCALE, enable_gqa=True, window=window, sinks=sinks
    )
    span = window or 11
    for b in range(2):
        expected = reference(
            rows(q, b), rows(k, b), rows(v, b), sinks, lambda i, j: 0 <= i - j < span
        )
        torch.testing.assert_close(rows(got, b), expected)


def test_training_padded_attention_with_sinks():
    q, k, v, sinks = tensors(2, 9)
    real = torch.tensor([[0, 0, 1, 1, 1, 1, 1, 1, 1], [1] * 9], dtype=torch.bool)  # left pad
    mask = torch.ones(9, 9, dtype=torch.bool).tril() & real[:, None, :]
    mask |= torch.eye(9, dtype=torch.bool)
    got = training_attention(q, k, v, mask[:, None], scale=SCALE, enable_gqa=True, sinks=sinks)
    for b in range(2):
        expected = reference(
            rows(q, b), rows(k, b), rows(v, b), sinks, lambda i, j, b=b: bool(mask[b, i, j])
        )
        torch.testing.assert_close(rows(got, b)[2:], expected[2:])  # real queries


@pytest.mark.parametrize("window", [None, 3])
def test_training_packed_documents_attention_with_sinks(window):
    q, k, v, sinks = tensors(2, 10)
    spans = DocumentSpans([[(0, 4), (4, 10)], [(0, 7), (7, 10)]])
    got = training_attention(
        q, k, v, spans, scale=SCALE, enable_gqa=True, window=window, sinks=sinks
    )
    span = window or 10
    for b, row in enumerate(spans.spans):
        doc = {t: n for n, (start, end) in enumerate(row) for t in range(start, end)}
        expected = reference(
            rows(q, b),
            rows(k, b),
            rows(v, b),
            sinks,
            lambda i, j, doc=doc: doc[i] == doc[j] and 0 <= i - j < span,
        )
        torch.testing.assert_close(rows(got, b), expected)


def paged_cache(kv_lens, q_lens, keys, values, slots):
    """A paged KVCache of one layer: request r's positions live at `slots[r]` (scattered),
    everything before its new tokens already written."""
    size = 64
    k_buf = torch.zeros(1, size, KV_HEADS, DIM)
    v_buf = torch.zeros(1, size, KV_HEADS, DIM)
    for r, (kv_len, q_len) in enumerate(zip(kv_lens, q_lens)):
        old = slots[r][: kv_len - q_len]
        k_buf[0, old] = keys[r][: kv_len - q_len]
        v_buf[0, old] = values[r][: kv_len - q_len]
    width = max(kv_lens)
    table = torch.zeros(len(kv_lens), width, dtype=torch.int32)
    for r, kv_len in enumerate(kv_lens):
        table[r, :kv_len] = slots[r]
    out_loc = torch.cat([slots[r][kv - ql :] for r, (kv, ql) in enumerate(zip(kv_lens, q_lens))])
    cum = lambda xs: torch.tensor([0, *torch.tensor(xs).cumsum(0).tolist()], dtype=torch.int32)  # noqa: E731
    return KVCache(
        k_buffer=k_buf,
        v_buffer=v_buf,
        req_to_token=table,
        req_pool_indices=torch.arange(len(kv_lens)),
        seq_lens=torch.tensor(kv_lens, dtype=torch.int32),
        out_cache_loc=out_loc.to(torch.int64),
        kv_indptr=cum(kv_lens),
        qo_indptr=cum(q_lens),
        max_len=max(kv_lens),
        max_q_len=max(q_lens),
        seq_lens_host=tuple(kv_lens),
        q_lens_host=tuple(q_lens),
    )


ENGINE_BACKENDS = [
    "torch_native",
    pytest.param("cpu", marks=NO_KERNEL),
    "triton",  # interpreted on the CPU (TRITON_INTERPRET=1, tests/conftest.py)
]


@pytest.mark.parametrize("backend", ENGINE_BACKENDS)
@pytest.mark.parametrize("window", [None, 5])
def test_engine_sink_attention_over_a_paged_cache(window, backend):
    """Request 0 extends a cached prefix (prefill of 4 after 9 cached), request 1 decodes;
    each backend (torch_native through `sink_attention`, the CPU kernel and Triton taking
    the sinks themselves)."""
    g = torch.Generator().manual_seed(1)
    kv_lens, q_lens = [13, 8], [4, 1]
    perm = torch.randperm(64, generator=g)
    slots = [perm[:13], perm[13:21]]
    keys = [torch.randn(n, KV_HEADS, DIM, generator=g) for n in kv_lens]
    values = [torch.randn(n, KV_HEADS, DIM, generator=g) for n in kv_lens]
    q = torch.randn(sum(q_lens), HEADS, DIM, generator=g)
    sinks = torch.randn(HEADS, generator=g) * 2
    cache = paged_cache(kv_lens, q_lens, keys, values, slots)
    new_k = torch.cat([keys[r][kv - ql :] for r, (kv, ql) in enumerate(zip(kv_lens, q_lens))])
    new_v = torch.cat([values[r][kv - ql :] for r, (kv, ql) in enumerate(zip(kv_lens, q_lens))])
    with attn_backend(backend):
        got = attention(q, new_k, new_v, cache, 0, scale=SCALE, window=window, sinks=sinks)
    start = 0
    for r, (kv_len, q_len) in enumerate(zip(kv_lens, q_lens)):
        span = window or kv_len
        first = kv_len - q_len

        def visible(i, j, first=first, span=span):
            return 0 <= first + i - j < span

        expected = reference(q[start : start + q_len], keys[r], values[r], sinks, visible)
        torch.testing.assert_close(got[start : start + q_len], expected, atol=2e-5, rtol=2e-5)
        start += q_len
    again = sink_attention(q, new_k, new_v, cache, 0, SCALE, window, sinks)
    torch.testing.assert_close(again, got, atol=2e-5, rtol=2e-5)


def test_explicit_flash_refuses_sinks(monkeypatch):
    """Even where flash-attn could serve the call (faked here: this may be a CPU machine)."""
    backend = "flash"
    monkeypatch.setattr(selection.get_backend(backend), "supports", lambda q, cache: None)
    q, k, v, sinks = tensors(1, 3)
    cache = paged_cache([3], [3], [rows(k, 0)], [rows(v, 0)], [torch.arange(3)])
    with attn_backend(backend), pytest.raises(BackendUnavailable, match="has no attention sinks"):
        attention(rows(q, 0), rows(k, 0), rows(v, 0), cache, 0, scale=SCALE, sinks=sinks)
