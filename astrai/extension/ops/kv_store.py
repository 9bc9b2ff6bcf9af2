"""Scatter a step's new K/V into the flat KV pool at `out_cache_loc`."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from astrai.extension.ops._common import check, launching, next_pow2


@triton.jit
def _store_kv_kernel(
    K,
    V,
    KBuf,
    VBuf,
    Loc,
    stride_kt,
    stride_vt,
    stride_kbt,
    stride_kbh,
    stride_vbt,
    stride_vbh,
    HEAD_DIM: tl.constexpr,
    ROW: tl.constexpr,
    BLOCK: tl.constexpr,
):
    t = tl.program_id(0)
    slot = tl.load(Loc + t).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < ROW
    # The buffer's heads need not be adjacent (a head-major pool): address them by stride.
    head, dim = offs // HEAD_DIM, offs % HEAD_DIM
    k = tl.load(K + t * stride_kt + offs, mask=mask)
    v = tl.load(V + t * stride_vt + offs, mask=mask)
    k_dst = KBuf + slot * stride_kbt + head * stride_kbh + dim
    v_dst = VBuf + slot * stride_vbt + head * stride_vbh + dim
    tl.store(k_dst, k.to(KBuf.dtype.element_ty), mask=mask)
    tl.store(v_dst, v.to(VBuf.dtype.element_ty), mask=mask)


def store_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    out_cache_loc: torch.Tensor,
) -> None:
    """`k_buffer[out_cache_loc] = k` and likewise for v; buffers are one layer `[size, H, D]`
    with a unit stride over D (token- or head-major)."""
    check(k, v, k_buffer, v_buffer)
    if k.shape[0] == 0:
        return
    n_heads, head_dim = k.shape[1:]
    if k_buffer.shape[1:] != (n_heads, head_dim) or v.shape != k.shape:
        raise ValueError(
            f"store_kv: k {tuple(k.shape)} / v {tuple(v.shape)} do not fit buffer rows "
            f"{tuple(k_buffer.shape[1:])}"
        )
    k, v = k.contiguous(), v.contiguous()
    row = n_heads * head_dim
    with launching():
        _store_kv_kernel[(k.shape[0],)](
            k,
            v,
            k_buffer,
            v_buffer,
            out_cache_loc,
            k.stride(0),
            v.stride(0),
            k_buffer.stride(0),
            k_buffer.stride(1),
            v_buffer.stride(0),
            v_buffer.stride(1),
            HEAD_DIM=head_dim,
            ROW=row,
            BLOCK=next_pow2(row),
        )
