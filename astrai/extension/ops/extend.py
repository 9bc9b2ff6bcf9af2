"""Ragged prefill / extend attention over packed queries.

Request `b` owns query rows `qo_indptr[b]:qo_indptr[b+1]` (its newest `q_len` positions)
and `seq_lens[b]` keys read through `req_to_token`: full attention over the cached prefix,
causal among the new tokens. One program per (request, query head, block of query rows).
A sliding-window layer (`window` > 0): a query at position p sees keys p - window < t <= p,
and a block's loop starts at the first key its first row sees. Attention sinks (GPT-OSS,
one logit per query head) join each row's denominator after the loop.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from astrai.extension.ops._common import check, launching, next_pow2
from astrai.extension.ops._online_softmax import attend_key_block


@triton.jit
def _extend_kernel(
    Q,
    K,
    V,
    Out,
    ReqToToken,
    ReqIdx,
    SeqLens,
    QoIndptr,
    Sinks,
    scale,
    window,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_ot,
    stride_oh,
    stride_rt,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PRECISION: tl.constexpr,
    HAS_SINKS: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    mblk = tl.program_id(2)
    q_start = tl.load(QoIndptr + b)
    q_len = tl.load(QoIndptr + b + 1) - q_start
    seq_len = tl.load(SeqLens + b)
    prefix = seq_len - q_len
    row = tl.load(ReqIdx + b).to(tl.int64)
    kvh = h // GROUP

    offs_m = mblk * BLOCK_M + tl.arange(0, BLOCK_M)
    mask_m = offs_m < q_len
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < HEAD_DIM
    q = tl.load(
        Q + (q_start + offs_m)[:, None].to(tl.int64) * stride_qt + h * stride_qh + offs_d[None, :],
        mask=mask_m[:, None] & mask_d[None, :],
        other=0.0,
    )
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    # Keys visible to the last row of this block; a block past q_len computes nothing.
    end = tl.minimum(seq_len, prefix + (mblk + 1) * BLOCK_M)
    end = tl.where(mblk * BLOCK_M < q_len, end, 0)
    # ... and the first key the block's first row sees (its window's start)
    first = tl.where(window > 0, tl.maximum(prefix + mblk * BLOCK_M - window + 1, 0), 0)
    for n0 in range(first, end, BLOCK_N):
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
            mask_n[None, :]
            & (offs_n[None, :] <= prefix + offs_m[:, None])  # causal
            & ((window == 0) | (offs_n[None, :] > prefix + offs_m[:, None] - window)),
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
    if HAS_SINKS:  # the head's sink logit: one more term of each row's denominator
        sink = tl.load(Sinks + h).to(tl.float32)
        m_new = tl.maximum(m_i, sink)
        alpha = tl.exp(m_i - m_new)
        acc = acc * alpha[:, None]
        l_i = l_i * alpha + tl.exp(sink - m_new)
    l_safe = tl.where(l_i > 0, l_i, 1.0)
    out_ptr = (
        Out + (q_start + offs_m)[:, None].to(tl.int64) * stride_ot + h * stride_oh + offs_d[None, :]
    )
    tl.store(
        out_ptr,
        (acc / l_safe[:, None]).to(Out.dtype.element_ty),
        mask=mask_m[:, None] & mask_d[None, :],
    )


def extend_attention(
    q: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    qo_indptr: torch.Tensor,
    max_q_len: int,
    scale: float,
    *,
    out: torch.Tensor | None = None,
    window: int | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Packed `q [T, H, D]` over one layer's `k/v_buffer [size, Hkv, D]` (already written);
    `window`: a sliding-window layer's window, None for full causal attention; `sinks`: `[H]`
    sink logits (GPT-OSS), None for none."""
    check(q, k_buffer, v_buffer, req_to_token)
    num_tokens, n_heads, head_dim = q.shape
    n_kv_heads = k_buffer.shape[1]
    if n_heads % n_kv_heads or k_buffer.shape[2] != head_dim:
        raise ValueError(
            f"extend_attention: q heads/dim {(n_heads, head_dim)} do not fit K/V "
            f"{tuple(k_buffer.shape[1:])}"
        )
    if out is None:
        out = torch.empty_like(q)
    batch = seq_lens.shape[0]
    if num_tokens == 0 or batch == 0:
        return out
    block_m = 32 if max_q_len > 16 else 16
    with launching():
        _extend_kernel[(batch, n_heads, triton.cdiv(max_q_len, block_m))](
            q,
            k_buffer,
            v_buffer,
            out,
            req_to_token,
            req_pool_indices,
            seq_lens,
            qo_indptr,
            seq_lens if sinks is None else sinks,  # unread without sinks
            scale,
            window or 0,
            q.stride(0),
            q.stride(1),
            k_buffer.stride(0),
            k_buffer.stride(1),
            v_buffer.stride(0),
            v_buffer.stride(1),
            out.stride(0),
            out.stride(1),
            req_to_token.stride(0),
            GROUP=n_heads // n_kv_heads,
            HEAD_DIM=head_dim,
            BLOCK_D=max(16, next_pow2(head_dim)),
            BLOCK_M=block_m,
            BLOCK_N=32,
            PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
            HAS_SINKS=sinks is not None,
        )
    return out
