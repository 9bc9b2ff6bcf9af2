"""Fused RoPE for q and k in one launch (half-split "rotate_half" convention, fp32 math)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from astrai.extension.ops._common import check, launching, next_pow2


@triton.jit
def _rotate_heads(
    X,
    Out,
    t,
    cos,
    sin,
    stride_xt,
    stride_xh,
    stride_ot,
    stride_oh,
    offs_h,
    offs_d,
    mask,
    HALF: tl.constexpr,
):
    base = X + t * stride_xt + offs_h[:, None] * stride_xh + offs_d[None, :]
    x1 = tl.load(base, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(base + HALF, mask=mask, other=0.0).to(tl.float32)
    o1 = x1 * cos[None, :] - x2 * sin[None, :]
    o2 = x2 * cos[None, :] + x1 * sin[None, :]
    out = Out + t * stride_ot + offs_h[:, None] * stride_oh + offs_d[None, :]
    tl.store(out, o1.to(Out.dtype.element_ty), mask=mask)
    tl.store(out + HALF, o2.to(Out.dtype.element_ty), mask=mask)


@triton.jit
def _rotary_kernel(
    Q,
    K,
    QOut,
    KOut,
    Cos,
    Sin,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_qot,
    stride_qoh,
    stride_kot,
    stride_koh,
    stride_ct,
    N_Q: tl.constexpr,
    N_K: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):
    t = tl.program_id(0)
    offs_d = tl.arange(0, BLOCK_HALF)
    mask_d = offs_d < HALF
    cos = tl.load(Cos + t * stride_ct + offs_d, mask=mask_d, other=0.0).to(tl.float32)
    sin = tl.load(Sin + t * stride_ct + offs_d, mask=mask_d, other=0.0).to(tl.float32)
    offs_q = tl.arange(0, BLOCK_Q)
    mask_q = (offs_q < N_Q)[:, None] & mask_d[None, :]
    _rotate_heads(
        Q,
        QOut,
        t,
        cos,
        sin,
        stride_qt,
        stride_qh,
        stride_qot,
        stride_qoh,
        offs_q,
        offs_d,
        mask_q,
        HALF,
    )
    offs_k = tl.arange(0, BLOCK_K)
    mask_k = (offs_k < N_K)[:, None] & mask_d[None, :]
    _rotate_heads(
        K,
        KOut,
        t,
        cos,
        sin,
        stride_kt,
        stride_kh,
        stride_kot,
        stride_koh,
        offs_k,
        offs_d,
        mask_k,
        HALF,
    )


def rotary_qk(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate packed `q [T, Hq, D]` and `k [T, Hk, D]` by per-token `cos`/`sin [T, D/2]`."""
    check(q, k, cos, sin)
    if q.dim() != 3 or k.dim() != 3 or q.shape[0] != k.shape[0] or q.shape[2] != k.shape[2]:
        raise ValueError(f"rotary_qk: q {tuple(q.shape)} and k {tuple(k.shape)} must be [T, H, D]")
    half = q.shape[2] // 2
    if cos.shape != (q.shape[0], half) or sin.shape != cos.shape:
        raise ValueError(
            f"rotary_qk: cos/sin must be [{q.shape[0]}, {half}], got {tuple(cos.shape)}"
        )
    q_out, k_out = torch.empty_like(q), torch.empty_like(k)
    if q.shape[0] == 0:
        return q_out, k_out
    q, k = q.contiguous(), k.contiguous()
    cos, sin = cos.contiguous(), sin.contiguous()
    with launching():
        _rotary_kernel[(q.shape[0],)](
            q,
            k,
            q_out,
            k_out,
            cos,
            sin,
            q.stride(0),
            q.stride(1),
            k.stride(0),
            k.stride(1),
            q_out.stride(0),
            q_out.stride(1),
            k_out.stride(0),
            k_out.stride(1),
            cos.stride(0),
            N_Q=q.shape[1],
            N_K=k.shape[1],
            HALF=half,
            BLOCK_Q=next_pow2(q.shape[1]),
            BLOCK_K=next_pow2(k.shape[1]),
            BLOCK_HALF=next_pow2(half),
        )
    return q_out, k_out
