"""PPO's clipped value loss against TRL's PPO trainer, transcribed below.

Source: github.com/huggingface/trl at tag v0.19.0 (commit
5b3ea9dd43b526f188ef8f63ca16bbe977ec8603), ``trl/trainer/ppo_trainer.py`` (the trainer was
removed from TRL later), ``PPOTrainer.train``'s value loss, and ``trl/core.py``'s
``masked_mean``; ``~padding_mask_p1`` is the mask of the response tokens. verl's
``compute_value_loss`` (``verl/trainer/ppo/core_algos.py``) is the same, copied from it.
The explained variance is verl's ``critic/vf_explained_var``
(``verl/trainer/ppo/metric_utils.py``, commit b178a3cd56f58b2d502255daba591e92833930a7).
"""

from __future__ import annotations

import pytest
import torch

from astrai.train.strategies.ppo.value_loss import clipped_value_loss, explained_variance


# ---------------------------------------------------------------------- TRL, transcribed
def trl_masked_mean(values, mask, axis=None):
    """Compute mean of tensor with a masked values."""
    if axis is not None:
        return (values * mask).sum(axis=axis) / mask.sum(axis=axis)
    else:
        return (values * mask).sum() / mask.sum()


def trl_value_loss(vpred, mb_values, mb_return, padding_mask_p1, cliprange_value):
    vpredclipped = torch.clamp(
        vpred,
        mb_values - cliprange_value,
        mb_values + cliprange_value,
    )
    vf_losses1 = torch.square(vpred - mb_return)
    vf_losses2 = torch.square(vpredclipped - mb_return)
    vf_loss_max = torch.max(vf_losses1, vf_losses2)
    vf_loss = 0.5 * trl_masked_mean(vf_loss_max, ~padding_mask_p1)
    vf_clipfrac = trl_masked_mean((vf_losses2 > vf_losses1).float(), ~padding_mask_p1)
    return vf_loss, vf_clipfrac


def verl_explained_var(returns, values, response_mask):
    valid_returns = torch.masked_select(returns, response_mask)
    valid_values = torch.masked_select(values, response_mask)
    return_diff_var = torch.var(valid_returns - valid_values)
    return_var = torch.var(valid_returns)
    return (1.0 - return_diff_var / (return_var + 1e-5)).detach().item()


# ---------------------------------------------------------------------- tests
def _tensors(seed: int):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.tensor([6, 2, 4, 1, 5])
    mask = torch.arange(6)[None, :] < lengths[:, None]
    old = torch.randn(5, 6, generator=g, dtype=torch.float64)
    # predictions near and far from the old values, so both branches of the max occur
    vpred = old + torch.randn(5, 6, generator=g, dtype=torch.float64) * 0.4
    returns = torch.randn(5, 6, generator=g, dtype=torch.float64)
    return vpred, old, returns, mask


@pytest.mark.parametrize("cliprange_value", [0.05, 0.2, 10.0])
def test_value_loss_and_gradient_equal_trls(cliprange_value):
    vpred, old, returns, mask = _tensors(int(cliprange_value * 100))
    ours_in = vpred.clone().requires_grad_(True)
    theirs_in = vpred.clone().requires_grad_(True)
    loss, clipfrac = clipped_value_loss(ours_in, returns, old, mask, cliprange_value)
    t_loss, t_clipfrac = trl_value_loss(theirs_in, old, returns, ~mask, cliprange_value)
    torch.testing.assert_close(loss, t_loss, rtol=1e-12, atol=1e-12)
    # TRL takes the fraction in float32 (`.float()`)
    torch.testing.assert_close(clipfrac, t_clipfrac.to(clipfrac.dtype), rtol=0, atol=1e-7)
    loss.backward()
    t_loss.backward()
    torch.testing.assert_close(ours_in.grad, theirs_in.grad, rtol=1e-12, atol=1e-12)
    if cliprange_value < 1.0:
        assert 0.0 < float(clipfrac) < 1.0  # the clip is engaged on some tokens, not all
    else:
        assert float(clipfrac) == 0.0


def test_the_clip_stops_the_gradient_beyond_the_range():
    """Token 0 moved past old + c towards its return: the clipped error is the larger and
    constant in the prediction, so no gradient flows there (PPO's pessimistic bound); token
    1 moved away from its return: the unclipped error is the larger and carries the
    gradient."""
    old = torch.zeros(1, 2, dtype=torch.float64)
    returns = torch.tensor([[1.0, 1.0]], dtype=torch.float64)
    vpred = torch.tensor([[0.5, -0.5]], dtype=torch.float64, requires_grad=True)
    loss, clipfrac = clipped_value_loss(vpred, returns, old, torch.ones(1, 2), 0.2)
    loss.backward()
    assert vpred.grad[0, 0] == 0 and vpred.grad[0, 1] != 0
    assert float(clipfrac) == 0.5
    # the loss: 0.5 * mean((0.2 - 1)^2, (-0.5 - 1)^2)
    assert float(loss) == pytest.approx(0.5 * (0.64 + 2.25) / 2)


def test_explained_variance_equals_verls():
    vpred, _, returns, mask = _tensors(7)
    assert explained_variance(returns, vpred, mask) == pytest.approx(
        verl_explained_var(returns, vpred, mask), abs=1e-12
    )
    assert explained_variance(returns, returns, mask) == pytest.approx(1.0, abs=1e-9)
