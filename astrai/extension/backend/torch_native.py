"""SDPA over K/V gathered through the page table: the always-available (and CPU) backend.

Decode steps run as one padded batch (one gather, one SDPA call, a key-length mask) and
fold each GQA group into the query axis, so K/V are never expanded per query head. Prefill
and mixed steps loop over the requests with several new tokens using the host-side lengths,
so nothing here forces a device sync; their one-token rows still run as one batched decode.
In batch-invariant mode (`astrai.extension.invariance`) every request attends alone over
exactly its own keys, by a kernel its own query and key lengths choose.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from astrai.extension.backend.base import AttentionBackend, shape_mismatch, write_kv
from astrai.extension.invariance import batch_invariant_enabled
from astrai.extension.kv_cache import KVCache, suffix_causal_mask


class TorchNativeBackend(AttentionBackend):
    """`F.scaled_dot_product_attention` on any device and any floating dtype."""

    name = "torch_native"

    def supports(self, q: torch.Tensor, kv_cache: KVCache) -> str | None:
        if not q.is_floating_point():
            return f"query dtype {q.dtype} is not a floating-point type"
        if not kv_cache.k_buffer.is_floating_point():
            return f"KV cache dtype {kv_cache.k_buffer.dtype}: an int8 cache needs the CPU kernel"
        return shape_mismatch(q, kv_cache)

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
        if batch_invariant_enabled():
            return _per_request(q, kv_cache, layer_id, scale)
        if kv_cache.is_decode:
            return self._decode(q, kv_cache, layer_id, scale)
        return self._extend(q, k, v, kv_cache, layer_id, scale)

    @staticmethod
    def _decode_strided(
        q: torch.Tensor, kv_cache: KVCache, layer_id: int, scale: float
    ) -> torch.Tensor:
        """Decode over contiguous rows: K/V are strided views of the buffers, never copied.

        Each segment of `row_segments` is one SDPA call over a range of pool rows padded to
        that range's longest row (idle rows in the range get a zero query and one visible
        key, so nothing is NaN); the active rows are picked out afterwards.
        """
        plan = kv_cache.plan.get("segments")
        if plan is None:
            plan = kv_cache.plan["segments"] = _SegmentPlan.build(kv_cache, q.device, q.dtype)
        batch, n_heads, head_dim = q.shape
        n_kv_heads = kv_cache.k_buffer.shape[-2]
        stride = kv_cache.row_stride
        grouped = q.reshape(batch, n_kv_heads, n_heads // n_kv_heads, head_dim)
        if plan.src is not None:  # lay the queries out row by row, zeros for idle rows
            grouped = torch.cat([grouped, grouped.new_zeros(1, *grouped.shape[1:])])[plan.src]
        k_buf, v_buf = kv_cache.k_buffer[layer_id], kv_cache.v_buffer[layer_id]
        outs = []
        for (lo, hi, length), (a, b), mask in zip(plan.ranges, plan.spans, plan.masks):
            shape = (hi - lo, stride, n_kv_heads, head_dim)
            keys = k_buf[lo * stride : hi * stride].view(shape)[:, :length]
            values = v_buf[lo * stride : hi * stride].view(shape)[:, :length]
            outs.append(
                F.scaled_dot_product_attention(
                    grouped[a:b],
                    keys.to(q.dtype).transpose(1, 2),
                    values.to(q.dtype).transpose(1, 2),
                    attn_mask=mask,
                    scale=scale,
                )
            )
        out = outs[0] if len(outs) == 1 else torch.cat(outs)
        if plan.dst is not None:
            out = out[plan.dst]
        return out.reshape(batch, n_heads, head_dim)

    @staticmethod
    def _decode(q: torch.Tensor, kv_cache: KVCache, layer_id: int, scale: float) -> torch.Tensor:
        if kv_cache.row_stride is not None and kv_cache.req_pool_indices_host:
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
        out = torch.empty_like(q)
        split = kv_cache.plan.get("decode_rows")
        if split is None:
            split = kv_cache.plan["decode_rows"] = _DecodeRows.build(kv_cache, q.device)
        if split.cache is not None:  # the one-token rows as one batched decode
            out[split.tokens] = TorchNativeBackend._decode(
                q.index_select(0, split.tokens), split.cache, layer_id, scale
            )
        for i, start, q_len, kv_len in kv_cache.request_spans():
            if i not in split.rows:
                out[start : start + q_len] = sdpa_request(
                    q, k, v, kv_cache, layer_id, scale, (i, start, q_len, kv_len)
                )
        return out


def sdpa_request(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: KVCache,
    layer_id: int,
    scale: float,
    span: tuple[int, int, int, int],
) -> torch.Tensor:
    """One request's extend rows `[q_len, heads, head_dim]` by one SDPA call: its keys are this
    step's own K/V when nothing was cached, else read back from the cache (an int8 cache's
    dequantized). `span` is one of
    `kv_cache.request_spans()`. Shared with the CPU kernel's backend, which leaves long
    prefill chunks to SDPA's blocked kernel."""
    i, start, q_len, kv_len = span
    if q_len == kv_len:  # nothing cached: this step's own K/V are the whole context
        keys, values = k[start : start + q_len], v[start : start + q_len]
    else:  # a cached prefix: read back (a plain slice in contiguous rows)
        keys = kv_cache.cached_rows(kv_cache.k_buffer[layer_id], i, kv_len)
        values = kv_cache.cached_rows(kv_cache.v_buffer[layer_id], i, kv_len)
        if kv_cache.k_scale is not None and kv_cache.v_scale is not None:  # int8: dequantize
            keys = (
                keys.float()
                * kv_cache.cached_rows(kv_cache.k_scale[layer_id], i, kv_len)[..., None]
            )
            values = (
                values.float()
                * kv_cache.cached_rows(kv_cache.v_scale[layer_id], i, kv_len)[..., None]
            )
    # 4-D [1, heads, len, D]: CPU SDPA takes its fused kernel only for 4-D inputs.
    keys = keys.to(q.dtype).transpose(0, 1)[None]
    values = values.to(q.dtype).transpose(0, 1)[None]
    queries = q[start : start + q_len].transpose(0, 1)[None]
    # the whole sequence computed now: the plain causal mask; else the suffix's
    mask = None if q_len == kv_len else suffix_causal_mask(q_len, kv_len, q.device)
    o = F.scaled_dot_product_attention(
        queries,
        keys,
        values,
        attn_mask=mask,
        is_causal=mask is None,
        scale=scale,
        enable_gqa=q.shape[1] != kv_cache.k_buffer.shape[-2],
    )
    return o[0].transpose(0, 1)


def _per_request(q: torch.Tensor, kv_cache: KVCache, layer_id: int, scale: float) -> torch.Tensor:
    """Batch-invariant attention: request by request over its keys read back from the cache
    (no padding to a longer neighbour), one query token without a mask, several with the
    causal mask of their place; nothing depends on the other requests of the step."""
    k_buf, v_buf = kv_cache.k_buffer[layer_id], kv_cache.v_buffer[layer_id]
    n_kv_heads = k_buf.shape[-2]
    out = torch.empty_like(q)
    for i, start, q_len, kv_len in kv_cache.request_spans():
        keys = kv_cache.cached_rows(k_buf, i, kv_len).to(q.dtype).transpose(0, 1)[None]
        values = kv_cache.cached_rows(v_buf, i, kv_len).to(q.dtype).transpose(0, 1)[None]
        queries = q[start : start + q_len]
        if q_len == 1:  # one query: every key visible; the GQA group as its query rows
            grouped = queries.reshape(1, n_kv_heads, -1, q.shape[-1])
            o = F.scaled_dot_product_attention(grouped, keys, values, scale=scale)
            out[start] = o.reshape(q.shape[1:])
        else:  # query j sits at position kv_len - q_len + j
            # the whole sequence now: the plain causal mask
            mask = None if q_len == kv_len else suffix_causal_mask(q_len, kv_len, q.device)
            o = F.scaled_dot_product_attention(
                queries.transpose(0, 1)[None],
                keys,
                values,
                attn_mask=mask,
                is_causal=mask is None,
                scale=scale,
                enable_gqa=q.shape[1] != n_kv_heads,
            )
            out[start : start + q_len] = o[0].transpose(0, 1)
    return out


@dataclass
class _DecodeRows:
    """The one-token rows of a mixed step (decode rows beside prefill chunks or speculative
    extend rows), batched as one decode: one SDPA call per segment for all of them instead
    of one per row (with 16 rows and one extend row, 8 layers did 128 calls instead of 16).
    `cache` is a `KVCache` over those rows only (None: fewer than two such rows); `tokens`
    their query rows in the step; `rows` their indices."""

    rows: frozenset[int]
    tokens: torch.Tensor | None = None
    cache: KVCache | None = None

    @classmethod
    def build(cls, kv_cache: KVCache, device: torch.device) -> _DecodeRows:
        picked, tokens, start = [], [], 0
        for i, (q_len, kv_len) in enumerate(zip(kv_cache.q_lens_host, kv_cache.seq_lens_host)):
            if q_len == 1 and kv_len > 1:
                picked.append(i)
                tokens.append(start)
            start += q_len
        if len(picked) < 2:
            return cls(frozenset())
        index = torch.tensor(picked, device=device)
        lens = tuple(kv_cache.seq_lens_host[i] for i in picked)
        host_rows = kv_cache.req_pool_indices_host
        cache = dataclasses.replace(
            kv_cache,
            req_pool_indices=kv_cache.req_pool_indices.index_select(0, index),
            seq_lens=kv_cache.seq_lens.index_select(0, index),
            max_len=max(lens),
            max_q_len=1,
            seq_lens_host=lens,
            q_lens_host=(1,) * len(picked),
            req_pool_indices_host=tuple(host_rows[i] for i in picked) if host_rows else (),
            plan={},
        )
        return cls(frozenset(picked), torch.tensor(tokens, device=device), cache)


# What one more SDPA call costs on the CPU, in (row, key) pairs read: fitted on replays of
# benchmark decode steps (astrai-30m shapes, 2 cores), where 384-768 all did about equally
# well and much smaller values lost to the per-call overhead.
CALL_COST_PAIRS = 512


def row_segments(
    rows: Sequence[int], lens: Sequence[int], call_cost: int = CALL_COST_PAIRS
) -> list[tuple[int, int, int]]:
    """Ranges `(lo, hi, length)` of pool rows that cover `rows` at the least attention cost.

    A strided view can only span a contiguous range of pool rows, and SDPA pads every row
    of a call to its longest one, so a range costs `(hi - lo) * length` pairs plus a fixed
    `call_cost`. Idle rows inside a range count as padding. Exact dynamic programming over
    the active rows in pool order: O(n^2) for n rows, once per step.
    """
    items = sorted(zip(rows, lens))
    pos = [row for row, _ in items]
    length = [n for _, n in items]
    n = len(items)
    best = [0] * (n + 1)
    cut = [0] * (n + 1)
    for j in range(n):
        end = pos[j] + 1
        longest, best_cost, best_i = 0, -1, j
        for i in range(j, -1, -1):
            if length[i] > longest:
                longest = length[i]
            span = (end - pos[i]) * longest + call_cost
            if best_cost >= 0 and span >= best_cost:
                break  # a range reaching further left is wider and as long: never cheaper
            cost = best[i] + span
            if best_cost < 0 or cost < best_cost:
                best_cost, best_i = cost, i
        best[j + 1], cut[j + 1] = best_cost, best_i
    ranges, j = [], n
    while j > 0:
        i = cut[j]
        ranges.append((pos[i], pos[j - 1] + 1, max(length[i:j])))
        j = i
    return ranges[::-1]


@dataclass
class _SegmentPlan:
    """Per-step layout of a segmented strided decode, shared by every layer of the step."""

    ranges: list[tuple[int, int, int]]  # (first pool row, end pool row, key length)
    spans: list[tuple[int, int]]  # each range's slice of the row-ordered query layout
    masks: list[torch.Tensor | None]  # [rows, 1, 1, length] 0 / -inf; None when all keys count
    src: torch.Tensor | None  # row-ordered position -> batch index (batch = a zero query)
    dst: torch.Tensor | None  # batch index -> row-ordered position

    @classmethod
    def build(cls, kv_cache: KVCache, device: torch.device, dtype: torch.dtype) -> _SegmentPlan:
        rows, lens = kv_cache.req_pool_indices_host, kv_cache.seq_lens_host
        batch = len(rows)
        ranges = row_segments(rows, lens)
        where = {row: i for i, row in enumerate(rows)}
        src, spans, masks = [], [], []
        for lo, hi, length in ranges:
            seg = [where.get(r, batch) for r in range(lo, hi)]
            spans.append((len(src), len(src) + len(seg)))
            src.extend(seg)
            seg_lens = [lens[i] if i < batch else 1 for i in seg]
            if all(n == length for n in seg_lens):
                masks.append(None)
            else:  # additive, in the query dtype: SDPA would convert a boolean mask per call
                valid = torch.arange(length) < torch.tensor(seg_lens)[:, None]
                bias = torch.zeros(valid.shape, dtype=dtype).masked_fill_(~valid, float("-inf"))
                masks.append(bias[:, None, None, :].to(device))
        if src == list(range(batch)):
            return cls(ranges, spans, masks, None, None)
        position = {b: p for p, b in enumerate(src) if b < batch}
        dst = torch.tensor([position[b] for b in range(batch)], device=device)
        return cls(ranges, spans, masks, torch.tensor(src, device=device), dst)
