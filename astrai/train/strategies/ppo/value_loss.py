"""PPO's critic objective: the clipped value loss and the explained variance.

TRL's PPO trainer (``trl/trainer/ppo_trainer.py``, v0.19; verl's ``compute_value_loss`` is
the same, copied from it): the prediction is clipped to ``cliprange_value`` around the
rollout-time value, the larger of the two squared errors to the return is taken, and half
its mean over the completion tokens is the loss (``vf_coef`` weighs it in the total).
"""

from __future__ import annotations

import torch
from torch import Tensor


def clipped_value_loss(
    values: Tensor,
    returns: Tensor,
    old_values: Tensor,
    mask: Tensor,
    cliprange_value: float,
) -> tuple[Tensor, Tensor]:
    """``(0.5 * masked mean of max((v - R)^2, (clip(v, v_old +- c) - R)^2), clip fraction)``
    over ``mask`` (``[N, T]``, any alignment shared by the four tensors); the fraction of
    tokens where the clipped error was the larger (TRL's ``vf_clipfrac``) is detached."""
    m = mask.to(values.dtype)
    clipped = torch.clamp(values, old_values - cliprange_value, old_values + cliprange_value)
    losses = torch.square(values - returns)
    losses_clipped = torch.square(clipped - returns)
    count = m.sum().clamp(min=1.0)
    loss = 0.5 * (torch.max(losses, losses_clipped) * m).sum() / count
    clipfrac = ((losses_clipped > losses).to(m.dtype) * m).sum() / count
    return loss, clipfrac.detach()


def explained_variance(returns: Tensor, values: Tensor, mask: Tensor) -> float:
    """verl's ``critic/vf_explained_var``: ``1 - Var(R - V) / (Var(R) + 1e-5)`` over the
    masked tokens (unbiased variances); 1 is a perfect critic, 0 one that predicts the mean."""
    keep = mask.bool()
    r, v = returns[keep].double(), values[keep].double()
    if r.numel() < 2:
        return 0.0
    return float(1.0 - torch.var(r - v) / (torch.var(r) + 1e-5))
