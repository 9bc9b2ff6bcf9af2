"""The extension's rotary dispatch must rotate exactly as the model layer does."""

from __future__ import annotations

import pytest
import torch

from astrai.extension import apply_rotary_emb
from astrai.model.rope import apply_rotary


def test_model_rotates_through_the_extension():
    """Training and serving must share one rotary function."""
    assert apply_rotary is apply_rotary_emb


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_matches_rotate_half_formula(dtype):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2, 5, 3, 16, generator=gen).to(dtype)  # [B, S, heads, head_dim]
    angles = torch.randn(2, 5, 8, generator=gen) * 10
    cos, sin = angles.cos(), angles.sin()
    out = apply_rotary_emb(x, cos, sin)
    assert out.dtype == dtype
    xf = x.float()
    rotate_half = torch.cat([-xf[..., 8:], xf[..., :8]], -1)
    c, s = torch.cat([cos, cos], -1)[:, :, None], torch.cat([sin, sin], -1)[:, :, None]
    torch.testing.assert_close(out.float(), (xf * c + rotate_half * s).to(dtype).float())


def test_rotates_half_split_pairs():
    """Pair (i, i + d/2) is rotated by angle i: checked on a hand-computed case."""
    x = torch.tensor([[[1.0, 2.0, 3.0, 4.0]]])  # one token, one head, head_dim 4
    angle = torch.tensor([[torch.pi / 2, 0.0]])
    out = apply_rotary_emb(x, angle.cos(), angle.sin())
    torch.testing.assert_close(out, torch.tensor([[[-3.0, 2.0, 1.0, 4.0]]]), atol=1e-6, rtol=0)


def test_differentiable():
    x = torch.randn(4, 2, 8, requires_grad=True)
    angles = torch.randn(4, 4)
    apply_rotary_emb(x, angles.cos(), angles.sin()).pow(2).sum().backward()
    # Rotation preserves norms, so d/dx sum(out^2) = 2x.
    torch.testing.assert_close(x.grad, 2 * x.detach(), atol=1e-5, rtol=1e-5)
