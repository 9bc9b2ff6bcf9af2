"""The key-block step of online softmax, shared by the decode and extend kernels."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def attend_key_block(
    q,
    K,
    V,
    slots,
    kvh,
    offs_d,
    kv_mask,
    visible,
    m_i,
    l_i,
    acc,
    scale,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    PRECISION: tl.constexpr,
):
    """Fold one block of keys (at page-table `slots`) into the running max `m_i`, sum `l_i`
    and output `acc` of the query rows `q`; `visible` masks scores (query row x key).

    Rows that have seen no visible key yet keep `m = -inf` and contribute nothing (the
    `-inf - -inf` NaN is avoided). Returns the new `(m_i, l_i, acc)`.
    """
    k = tl.load(
        K + slots[:, None] * stride_kt + kvh * stride_kh + offs_d[None, :],
        mask=kv_mask,
        other=0.0,
    )
    s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
    s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.where(m_new == float("-inf"), 1.0, tl.exp(m_i - m_new))
    p = tl.where(visible, tl.exp(s - m_new[:, None]), 0.0)
    l_i = l_i * alpha + tl.sum(p, 1)
    v = tl.load(
        V + slots[:, None] * stride_vt + kvh * stride_vh + offs_d[None, :],
        mask=kv_mask,
        other=0.0,
    )
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
    return m_new, l_i, acc
