"""Random paged KV caches and an independent dense reference for the attention tests."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from astrai.extension import KVCache

N_LAYERS = 2
LAYER = 1


@dataclass
class Case:
    cache: KVCache
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    slots: list[torch.Tensor]  # per request: the physical slot of every position
    prefix_lens: list[int]


def make_case(
    reqs: list[tuple[int, int]],
    *,
    n_heads: int,
    n_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    contiguous: bool = False,
    head_major: bool = False,
) -> Case:
    """`reqs` = [(cached prefix length, new tokens)]; slots are a random permutation of a
    buffer twice the needed size, page-table rows are random, and unused table entries hold
    an out-of-range slot so that a backend reading past a request's length crashes.

    `contiguous=True` lays the pool out as the contiguous cache mode does instead: row r owns
    slots `r * max_ctx + position`, and the cache says so through `row_stride`.
    `head_major=True` stores the buffers with each head's slots together (same shape)."""
    gen = torch.Generator().manual_seed(seed)
    total = sum(p + n for p, n in reqs)
    size = 2 * total + 3
    perm = torch.randperm(size, generator=gen)
    max_ctx = max(p + n for p, n in reqs) + 4
    num_pool_rows = len(reqs) + 3
    req_to_token = torch.full((num_pool_rows, max_ctx), size + 1000, dtype=torch.int32)
    pool_rows = torch.randperm(num_pool_rows, generator=gen)[: len(reqs)]
    if contiguous:
        size = num_pool_rows * max_ctx
    shape = (N_LAYERS, size, n_kv_heads, head_dim)
    k_buffer = torch.randn(shape, generator=gen).to(dtype)
    v_buffer = torch.randn(shape, generator=gen).to(dtype)
    if head_major:
        k_buffer = k_buffer.transpose(1, 2).contiguous().transpose(1, 2)
        v_buffer = v_buffer.transpose(1, 2).contiguous().transpose(1, 2)
    slots, out_loc, offset = [], [], 0
    for row, (prefix, new) in zip(pool_rows.tolist(), reqs):
        if contiguous:
            s = row * max_ctx + torch.arange(prefix + new)
        else:
            s = perm[offset : offset + prefix + new]
        offset += prefix + new
        req_to_token[row, : prefix + new] = s.to(torch.int32)
        slots.append(s)
        out_loc.append(s[prefix:])
    num_tokens = sum(n for _, n in reqs)
    q = torch.randn(num_tokens, n_heads, head_dim, generator=gen).to(dtype)
    k = torch.randn(num_tokens, n_kv_heads, head_dim, generator=gen).to(dtype)
    v = torch.randn(num_tokens, n_kv_heads, head_dim, generator=gen).to(dtype)
    seq_lens = [p + n for p, n in reqs]
    q_lens = [n for _, n in reqs]
    cache = KVCache(
        k_buffer=k_buffer,
        v_buffer=v_buffer,
        req_to_token=req_to_token,
        req_pool_indices=pool_rows.to(torch.int64),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        out_cache_loc=torch.cat(out_loc).to(torch.int64),
        kv_indptr=torch.tensor([0, *torch.tensor(seq_lens).cumsum(0).tolist()], dtype=torch.int32),
        qo_indptr=torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32),
        max_len=max(seq_lens),
        max_q_len=max(q_lens),
        seq_lens_host=tuple(seq_lens),
        q_lens_host=tuple(q_lens),
        req_pool_indices_host=tuple(pool_rows.tolist()),
        row_stride=max_ctx if contiguous else None,
    )
    return Case(cache, q, k, v, slots, [p for p, _ in reqs])


def reference(
    case: Case,
    k_before: torch.Tensor,
    v_before: torch.Tensor,
    scale: float,
    window: int | None = None,
    sinks: torch.Tensor | None = None,
):
    """Dense per-request causal attention in float64 from the cache contents before the call
    (the cached prefix) plus this step's k/v, GQA by repeat_interleave; with `window`, a
    query at position p sees keys p - window < t <= p (transformers' sliding window); with
    `sinks` ([heads]), each head's softmax has one more column no value stands behind."""
    outs, start = [], 0
    n_heads, n_kv = case.q.shape[1], case.k.shape[1]
    for slots, prefix in zip(case.slots, case.prefix_lens):
        n = len(slots) - prefix
        keys = torch.cat([k_before[LAYER, slots[:prefix]], case.k[start : start + n]]).double()
        vals = torch.cat([v_before[LAYER, slots[:prefix]], case.v[start : start + n]]).double()
        keys = keys.repeat_interleave(n_heads // n_kv, dim=1)  # [L, H, D]
        vals = vals.repeat_interleave(n_heads // n_kv, dim=1)
        q = case.q[start : start + n].double()  # [n, H, D]
        scores = torch.einsum("nhd,lhd->hnl", q, keys) * scale
        pos_q = prefix + torch.arange(n)[:, None]
        visible = torch.arange(len(slots))[None, :] <= pos_q
        if window is not None:
            visible &= torch.arange(len(slots))[None, :] > pos_q - window
        scores = scores.masked_fill(~visible, float("-inf"))
        if sinks is not None:
            column = sinks.double()[:, None, None].expand(-1, n, 1)
            probs = torch.cat([scores, column], dim=-1).softmax(-1)[..., :-1]
        else:
            probs = scores.softmax(-1)
        outs.append(torch.einsum("hnl,lhd->nhd", probs, vals))
        start += n
    return torch.cat(outs)
