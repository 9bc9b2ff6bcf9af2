"""Rotary embedding dispatch shared by every attention backend.

Half-split ("rotate_half") convention in fp32, exactly as `astrai.model.layers.apply_rotary`,
so training and serving rotate identically. Only the torch path exists today; a fused Triton
kernel (from `astrai.extension.ops`, for CUDA inputs with grad disabled) will be dispatched
from `apply_rotary_emb` when it lands, and the torch path stays for autograd and CPU.
"""

from __future__ import annotations

import torch


def rotary_torch(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate `x[..., heads, head_dim]` by per-token `cos`/`sin[..., head_dim // 2]` in fp32."""
    dtype = x.dtype
    x1, x2 = x.to(torch.float32).chunk(2, dim=-1)
    cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(dtype)


def apply_rotary_emb(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Apply RoPE to `x[..., heads, head_dim]`; cos/sin are `[..., head_dim // 2]`, broadcast
    over heads. Differentiable; returns x's dtype."""
    # Seam: the Triton rotary kernel is selected here once astrai.extension.ops provides it.
    return rotary_torch(x, cos, sin)
