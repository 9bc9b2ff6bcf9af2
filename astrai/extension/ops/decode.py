"""Paged decode attention with split-KV (flash-decoding).

Stage 1 runs one program per (request, KV head, split): it attends the GQA group's query
heads (padded to a tile of at least 16 rows for `tl.dot`) over its share of the request's
keys, read through the page table `req_to_token` (each token slot is a one-token page),
and writes a partial output and its log-sum-exp. Stage 2 merges the splits per head.
Splitting the key range keeps the GPU busy when the batch is small and sequences are long.
A sliding-window layer (`window` > 0) splits and reads only the last `window` keys.
Attention sinks (GPT-OSS, one logit per query head) join the denominator in stage 2.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from astrai.extension.ops._common import check, launching, next_pow2
from astrai.extension.ops._online_softmax import attend_key_block


@triton.jit
def _decode_stage1(
    Q,
    K,
    V,
    ReqToToken,
    ReqIdx,
    SeqLens,
    PartO,
    PartLse,
    scale,
    window,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_rt,
    stride_pob,
    stride_poh,
    stride_pos,
    stride_plb,
    stride_plh,
    GROUP: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PRECISION: tl.constexpr,
):
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(SeqLens + b)
    row = tl.load(ReqIdx + b).to(tl.int64)
    # the query (position seq_len - 1) sees keys from `lo` on: all, or its window's
    lo = tl.where(window > 0, tl.maximum(seq_len - window, 0), 0)
    chunk = tl.cdiv(seq_len - lo, NUM_SPLITS)
    start = lo + split * chunk
    end = tl.minimum(start + chunk, seq_len)

    offs_g = tl.arange(0, BLOCK_H)
    mask_h = offs_g < GROUP
    heads = kvh * GROUP + offs_g
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < HEAD_DIM
    q = tl.load(
        Q + b * stride_qt + heads[:, None] * stride_qh + offs_d[None, :],
        mask=mask_h[:, None] & mask_d[None, :],
        other=0.0,
    )
    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    for n0 in range(start, end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        mask_n = offs_n < end
        slots = tl.load(ReqToToken + row * stride_rt + offs_n, mask=mask_n, other=0).to(tl.int64)
        m_i, l_i, acc = attend_key_block(
            q,
            K,
            V,
            slots,
            kvh,
            offs_d,
            mask_n[:, None] & mask_d[None, :],
            mask_n[None, :],
            m_i,
            l_i,
            acc,
            scale,
            stride_kt,
            stride_kh,
            stride_vt,
            stride_vh,
            PRECISION,
        )
    # An empty split (seq_len < NUM_SPLITS) leaves l_i == 0: output 0 with lse -inf, so
    # stage 2 gives it no weight.
    l_safe = tl.where(l_i > 0, l_i, 1.0)
    lse = tl.where(l_i > 0, m_i + tl.log(l_safe), float("-inf"))
    out_ptr = (
        PartO + b * stride_pob + heads[:, None] * stride_poh + split * stride_pos + offs_d[None, :]
    )
    tl.store(out_ptr, acc / l_safe[:, None], mask=mask_h[:, None] & mask_d[None, :])
    tl.store(PartLse + b * stride_plb + heads * stride_plh + split, lse, mask=mask_h)


@triton.jit
def _decode_stage2(
    PartO,
    PartLse,
    Out,
    Sinks,
    stride_pob,
    stride_poh,
    stride_pos,
    stride_plb,
    stride_plh,
    stride_ot,
    stride_oh,
    NUM_SPLITS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_S: tl.constexpr,
    HAS_SINKS: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    mask_s = offs_s < NUM_SPLITS
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < HEAD_DIM
    lse = tl.load(
        PartLse + b * stride_plb + h * stride_plh + offs_s, mask=mask_s, other=float("-inf")
    )
    m = tl.max(lse, 0)
    if HAS_SINKS:  # the head's sink logit: one more term of the denominator, no value
        sink = tl.load(Sinks + h).to(tl.float32)
        m = tl.maximum(m, sink)
    w = tl.exp(lse - m)
    o = tl.load(
        PartO + b * stride_pob + h * stride_poh + offs_s[:, None] * stride_pos + offs_d[None, :],
        mask=mask_s[:, None] & mask_d[None, :],
        other=0.0,
    )
    denom = tl.sum(w, 0)
    if HAS_SINKS:
        denom += tl.exp(sink - m)
    out = tl.sum(o * w[:, None], 0) / denom
    tl.store(
        Out + b * stride_ot + h * stride_oh + offs_d, out.to(Out.dtype.element_ty), mask=mask_d
    )


def decode_attention(
    q: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    *,
    num_splits: int = 4,
    out: torch.Tensor | None = None,
    partial_out: torch.Tensor | None = None,
    partial_lse: torch.Tensor | None = None,
    window: int | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """One query token per request: `q [B, H, D]` over one layer's `k/v_buffer [size, Hkv, D]`;
    `window`: a sliding-window layer's window (the last `window` keys), None for all;
    `sinks`: `[H]` sink logits (GPT-OSS), None for none.

    `out`, `partial_out [B, H, splits, D]` (fp32) and `partial_lse [B, H, splits]` (fp32)
    may be preallocated (the decode workspace does, for fixed addresses); otherwise they
    are allocated here.
    """
    check(q, k_buffer, v_buffer, req_to_token)
    batch, n_heads, head_dim = q.shape
    n_kv_heads = k_buffer.shape[1]
    if n_heads % n_kv_heads or k_buffer.shape[2] != head_dim:
        raise ValueError(
            f"decode_attention: q heads/dim {(n_heads, head_dim)} do not fit K/V "
            f"{tuple(k_buffer.shape[1:])}"
        )
    if num_splits < 1:
        raise ValueError(f"decode_attention: num_splits must be >= 1, got {num_splits}")
    group = n_heads // n_kv_heads
    if out is None:
        out = torch.empty_like(q)
    if partial_out is None:
        partial_out = torch.empty(
            (batch, n_heads, num_splits, head_dim), dtype=torch.float32, device=q.device
        )
    if partial_lse is None:
        partial_lse = torch.empty(
            (batch, n_heads, num_splits), dtype=torch.float32, device=q.device
        )
    if batch == 0:
        return out
    block_d = max(16, next_pow2(head_dim))
    with launching():
        _decode_stage1[(batch, n_kv_heads, num_splits)](
            q,
            k_buffer,
            v_buffer,
            req_to_token,
            req_pool_indices,
            seq_lens,
            partial_out,
            partial_lse,
            scale,
            window or 0,
            q.stride(0),
            q.stride(1),
            k_buffer.stride(0),
            k_buffer.stride(1),
            v_buffer.stride(0),
            v_buffer.stride(1),
            req_to_token.stride(0),
            partial_out.stride(0),
            partial_out.stride(1),
            partial_out.stride(2),
            partial_lse.stride(0),
            partial_lse.stride(1),
            GROUP=group,
            NUM_SPLITS=num_splits,
            HEAD_DIM=head_dim,
            BLOCK_D=block_d,
            BLOCK_H=max(16, next_pow2(group)),
            BLOCK_N=32,
            PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        )
    with launching():
        _decode_stage2[(batch, n_heads)](
            partial_out,
            partial_lse,
            out,
            partial_lse if sinks is None else sinks,  # unread without sinks
            partial_out.stride(0),
            partial_out.stride(1),
            partial_out.stride(2),
            partial_lse.stride(0),
            partial_lse.stride(1),
            out.stride(0),
            out.stride(1),
            NUM_SPLITS=num_splits,
            HEAD_DIM=head_dim,
            BLOCK_D=block_d,
            BLOCK_S=next_pow2(num_splits),
            HAS_SINKS=sinks is not None,
        )
    return out
