"""What the chunked-head tests share: the comparison "equal to 1e-6" of a chunked and a dense
fp32 computation, relative to the compared tensor's largest element (fp32 sums of different
orders differ by a few ulps of that scale: a gradient of size 20 differs by ~4e-6)."""

from __future__ import annotations

import torch

TOL = 1e-6


def assert_close_1e6(got: torch.Tensor, want: torch.Tensor, what: str = "") -> None:
    """``max |got - want| <= 1e-6 * max(1, max |want|)``."""
    assert got.shape == want.shape, (what, got.shape, want.shape)
    scale = max(1.0, float(want.detach().abs().max())) if want.numel() else 1.0
    err = float((got - want).detach().abs().max()) if want.numel() else 0.0
    assert err <= TOL * scale, f"{what}: max abs difference {err:.3g} > 1e-6 * {scale:.3g}"


def assert_grads_close(got: dict[str, torch.Tensor], model: torch.nn.Module) -> None:
    """Every trainable parameter's gradient of ``model`` against ``got`` (name -> gradient)."""
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    assert sorted(names) == sorted(got), "the two runs trained other parameters"
    for name, p in model.named_parameters():
        if p.requires_grad:
            assert (p.grad is None) == (got[name] is None), name
            if p.grad is not None:
                assert_close_1e6(got[name], p.grad, name)
