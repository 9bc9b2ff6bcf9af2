"""Rotary embedding dispatch shared by training and every attention backend.

Half-split ("rotate_half") convention in fp32. `apply_rotary_qk` rotates q and k in one
fused Triton launch when that kernel can serve the call (CUDA tensors, packed
`[tokens, heads, head_dim]`, no autograd, i.e. inference); otherwise, and always during
training, the differentiable torch path runs.
"""

from __future__ import annotations

import torch

from astrai.extension import ops


def rotary_torch(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate `x[..., heads, head_dim]` by per-token `cos`/`sin[..., head_dim // 2]` in fp32."""
    dtype = x.dtype
    x1, x2 = x.to(torch.float32).chunk(2, dim=-1)
    cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(dtype)


def apply_rotary_emb(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Apply RoPE to `x[..., heads, head_dim]`; cos/sin are `[..., head_dim // 2]`, broadcast
    over heads. Differentiable; returns x's dtype."""
    return rotary_torch(x, cos, sin)


def _fused_ok(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor) -> bool:
    return (
        q.is_cuda
        and q.dim() == 3
        and cos.dim() == 2
        and not torch.is_grad_enabled()
        and ops.unusable(q, k) is None
    )


def apply_rotary_qk(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """RoPE for q and k together: the fused kernel at inference on CUDA, torch otherwise."""
    if _fused_ok(q, k, cos):
        return ops.rotary_qk(q, k, cos, sin)
    if not torch.is_grad_enabled() and q.shape[:-2] == k.shape[:-2]:
        # Inference without the fused kernel: rotating q and k side by side halves the ops.
        qk = rotary_torch(torch.cat((q, k), dim=-2), cos, sin)
        return qk.split((q.shape[-2], k.shape[-2]), dim=-2)
    return rotary_torch(q, cos, sin), rotary_torch(k, cos, sin)
