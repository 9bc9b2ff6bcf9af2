"""Multi-LoRA per-token delta (S-LoRA / Punica's SGMV): `out[t] += s * (x[t] A^T) B^T`
with A, B and the scaling s those of token t's adapter slot.

Two launches: "shrink" projects each token onto its slot's rank, `h[t] = s * x[t] A^T`
(one program per token and rank block, looping over `in`), into an fp32 scratch `[T, R]`;
"expand" adds `h[t] B^T` to `out` (one program per token and `out` block, looping over
the rank). Each program reads its token's slot and gathers only that slot's rows of the
stacks, so one launch serves any mix of adapters; tokens of slot -1 return at once.
The ranks are small (8 to 64), too small a tile for `tl.dot`, so both products are
`tl.sum` over broadcast tiles: exact fp32 accumulation, and correct in the interpreter.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from astrai.extension.ops._common import check, launching, next_pow2


@triton.jit
def _shrink_kernel(
    X,
    A,
    Slots,
    Scalings,
    H,
    stride_xt,
    stride_xk,
    stride_as,
    stride_ar,
    stride_ak,
    stride_ht,
    IN: tl.constexpr,
    RANK: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(Slots + t).to(tl.int64)
    if slot < 0:
        return
    offs_r = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
    mask_r = offs_r < RANK
    a_rows = A + slot * stride_as + offs_r[:, None] * stride_ar
    acc = tl.zeros([BLOCK_R], tl.float32)
    for k0 in range(0, IN, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask_k = offs_k < IN
        x = tl.load(X + t * stride_xt + offs_k * stride_xk, mask=mask_k, other=0.0)
        a = tl.load(
            a_rows + offs_k[None, :] * stride_ak, mask=mask_r[:, None] & mask_k[None, :], other=0.0
        )
        acc += tl.sum(a.to(tl.float32) * x.to(tl.float32)[None, :], 1)
    scaling = tl.load(Scalings + slot)
    tl.store(H + t * stride_ht + offs_r, acc * scaling, mask=mask_r)


@triton.jit
def _expand_kernel(
    H,
    BT,
    Slots,
    Out,
    stride_ht,
    stride_bs,
    stride_br,
    stride_bn,
    stride_ot,
    stride_on,
    OUT: tl.constexpr,
    RANK: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(Slots + t).to(tl.int64)
    if slot < 0:
        return
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < OUT
    acc = tl.zeros([BLOCK_N], tl.float32)
    for r0 in range(0, RANK, BLOCK_R):
        offs_r = r0 + tl.arange(0, BLOCK_R)
        mask_r = offs_r < RANK
        h = tl.load(H + t * stride_ht + offs_r, mask=mask_r, other=0.0)
        b = tl.load(
            BT + slot * stride_bs + offs_r[:, None] * stride_br + offs_n[None, :] * stride_bn,
            mask=mask_r[:, None] & mask_n[None, :],
            other=0.0,
        )
        acc += tl.sum(h[:, None] * b.to(tl.float32), 0)
    out_ptr = Out + t * stride_ot + offs_n * stride_on
    base = tl.load(out_ptr, mask=mask_n, other=0.0).to(tl.float32)
    tl.store(out_ptr, (base + acc).to(Out.dtype.element_ty), mask=mask_n)


def sgmv_lora(
    x: torch.Tensor,
    a3: torch.Tensor,
    bt3: torch.Tensor,
    token_slots: torch.Tensor,
    scalings: torch.Tensor,
    out: torch.Tensor,
) -> None:
    """`out[t] += scalings[s] * (x[t] @ a3[s].T) @ bt3[s]` with `s = token_slots[t]`, in place;
    rows whose slot is -1 are left unchanged.

    `x` `[T, in]`, `a3` `[S, R, in]`, `bt3` `[S, R, out]` (B transposed), `token_slots` `[T]`
    int (each in `[-1, S)`, not checked: that would synchronise), `scalings` `[S]`, `out`
    `[T, out]`, any strides (a column slice of a wider output is fine). Accumulates in fp32.
    """
    check(x, a3, bt3, token_slots, scalings, out)
    n_tokens, d_in = x.shape
    n_slots, rank, d_out = bt3.shape
    if (
        a3.shape != (n_slots, rank, d_in)
        or out.shape != (n_tokens, d_out)
        or token_slots.shape != (n_tokens,)
        or scalings.shape != (n_slots,)
    ):
        raise ValueError(
            f"sgmv_lora: shapes do not fit: x {tuple(x.shape)}, a3 {tuple(a3.shape)}, "
            f"bt3 {tuple(bt3.shape)}, token_slots {tuple(token_slots.shape)}, "
            f"scalings {tuple(scalings.shape)}, out {tuple(out.shape)}"
        )
    devices = {t.device for t in (x, a3, bt3, token_slots, scalings, out)}
    if len(devices) != 1:
        raise ValueError(f"sgmv_lora: tensors on several devices {sorted(map(str, devices))}")
    if n_tokens == 0 or rank == 0 or d_out == 0:
        return
    scalings = scalings.float()
    h = torch.empty((n_tokens, rank), dtype=torch.float32, device=x.device)
    block_r = min(next_pow2(rank), 32)
    block_k = min(next_pow2(d_in), 128)
    with launching():
        _shrink_kernel[(n_tokens, triton.cdiv(rank, block_r))](
            x,
            a3,
            token_slots,
            scalings,
            h,
            x.stride(0),
            x.stride(1),
            a3.stride(0),
            a3.stride(1),
            a3.stride(2),
            h.stride(0),
            IN=d_in,
            RANK=rank,
            BLOCK_R=block_r,
            BLOCK_K=block_k,
        )
    block_n = min(next_pow2(d_out), 128)
    with launching():
        _expand_kernel[(n_tokens, triton.cdiv(d_out, block_n))](
            h,
            bt3,
            token_slots,
            out,
            h.stride(0),
            bt3.stride(0),
            bt3.stride(1),
            bt3.stride(2),
            out.stride(0),
            out.stride(1),
            OUT=d_out,
            RANK=rank,
            BLOCK_R=min(next_pow2(rank), 16),
            BLOCK_N=block_n,
        )
