"""`RMSNorm`: fp32 inference takes fewer ops (four in-place ones on the CPU, the weight in
torch's fused op elsewhere); every path equals the plain formula, and inference equals
training bit for bit (log-probs agree with training)."""

from __future__ import annotations

import pytest
import torch

from astrai.model.layers import RMSNorm


def _reference(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    h = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps)
    return w * h.to(x.dtype)


@pytest.mark.parametrize("shape", [(1, 64), (48, 64), (3, 5, 4, 64), (300, 512), (16, 6, 96)])
def test_inference_equals_training_and_the_formula(shape):
    gen = torch.Generator().manual_seed(len(shape))
    dim = shape[-1]
    norm = RMSNorm(dim, eps=1e-5)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(dim, generator=gen))
    x = torch.randn(shape, generator=gen)
    trained = norm(x)
    with torch.inference_mode():
        served = norm(x)
    assert torch.equal(served, trained.detach())
    torch.testing.assert_close(served, _reference(x, norm.weight.detach(), 1e-5))


def test_half_precision_normalises_in_fp32_then_casts():
    norm = RMSNorm(32).to(torch.bfloat16)
    x = torch.randn(4, 32, dtype=torch.bfloat16) * 30
    with torch.inference_mode():
        out = norm(x)
    assert out.dtype == torch.bfloat16
    assert torch.equal(out, _reference(x, norm.weight, norm.eps))
