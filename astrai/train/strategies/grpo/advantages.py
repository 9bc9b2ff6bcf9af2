"""Advantage estimators for GRPO-style training, from one scalar reward per completion.

``advantage`` takes verl's estimator names (``algorithm.adv_estimator``), ``scale_rewards``
TRL's (``GRPOConfig.scale_rewards``):

- ``grpo``: ``r - mean(group)``, divided by the group's std (``scale_rewards: group``, TRL's
  default), by the whole batch's std (``batch``, "PPO Lite") or not at all (``none``,
  Dr. GRPO);
- ``rloo``: ``r - mean(the other completions of the group)`` (leave-one-out; TRL's
  ``RLOOTrainer``, verl's ``rloo``); ``scale_rewards: batch`` then whitens these over the
  batch (TRL ``RLOOConfig.normalize_advantages``); default ``none``;
- ``reinforce_pp``: REINFORCE++ (verl): the outcome reward sits on the completion's last
  token, each token's return is its discounted sum (``gamma``), and the returns are whitened
  over every completion token of the batch (token-weighted: longer completions count more);
  one advantage per token;
- ``reinforce_pp_baseline``: verl's REINFORCE++-baseline: ``r - mean(group)`` on every token,
  whitened over the batch's completion tokens.

"The batch" is the whole generation batch on every rank: ``all_sum`` sums a tensor over the
ranks (None: one process).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

ESTIMATORS = ("grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline")
SCALE_REWARDS = ("group", "batch", "none")
# Each estimator's own default and the scalings that mean something for it.
DEFAULT_SCALE = {
    "grpo": "group",
    "rloo": "none",
    "reinforce_pp": "batch",
    "reinforce_pp_baseline": "batch",
}
ALLOWED_SCALE = {
    "grpo": SCALE_REWARDS,
    "rloo": ("none", "batch"),
    "reinforce_pp": ("batch", "none"),
    "reinforce_pp_baseline": ("batch", "none"),
}
#: The estimators whose advantages are one per token ``[N, T]`` (the others: ``[N]``).
PER_TOKEN = ("reinforce_pp", "reinforce_pp_baseline")

AllSum = Callable[[Tensor], Tensor]


def check_advantage_options(
    advantage: str, scale_rewards: str | bool | None, gamma: float = 1.0
) -> str:
    """The resolved ``scale_rewards`` (None: the estimator's default; TRL's booleans: True is
    ``group``, False ``none``); a ValueError names the field and the choices."""
    if advantage not in ESTIMATORS:
        raise ValueError(f"GRPO advantage must be one of {ESTIMATORS}, got {advantage!r}")
    if isinstance(scale_rewards, bool):
        scale_rewards = "group" if scale_rewards else "none"
    scale = DEFAULT_SCALE[advantage] if scale_rewards is None else scale_rewards
    if scale not in ALLOWED_SCALE[advantage]:
        raise ValueError(
            f"GRPO scale_rewards={scale!r} does not apply to advantage={advantage!r}: "
            f"choose one of {ALLOWED_SCALE[advantage]} (or null: {DEFAULT_SCALE[advantage]})"
        )
    if not 0.0 < float(gamma) <= 1.0:
        raise ValueError(f"GRPO gamma (reinforce_pp's discount) must be in (0, 1], got {gamma}")
    return scale


def group_advantages(rewards: Tensor, eps: float = 1e-4) -> Tensor:
    """``(r - mean_g) / (std_g + eps)`` within each group: ``[B, G] -> [B, G]``.

    ``std`` is the unbiased sample standard deviation (as in DeepSeekMath / TRL); a group whose
    completions all got the same reward has zero advantage and contributes no policy gradient.
    """
    _check_groups(rewards)
    mean = rewards.mean(dim=1, keepdim=True)
    std = rewards.std(dim=1, keepdim=True)
    return (rewards - mean) / (std + eps)


def _check_groups(rewards: Tensor) -> None:
    if rewards.dim() != 2:
        raise ValueError(f"advantages: expected [prompts, G], got {tuple(rewards.shape)}")
    if rewards.shape[1] < 2:
        raise ValueError("advantages: need at least 2 completions per prompt")


def _sum(x: Tensor, all_sum: AllSum | None) -> Tensor:
    return all_sum(x) if all_sum is not None else x


def batch_std(x: Tensor, all_sum: AllSum | None = None) -> Tensor:
    """Unbiased std of every element of ``x`` on all ranks (TRL's ``nanstd`` of the gathered
    rewards)."""
    totals = _sum(torch.stack([x.sum(), torch.tensor(float(x.numel()), device=x.device)]), all_sum)
    mean = totals[0] / totals[1]
    squares = _sum(((x - mean) ** 2).sum(), all_sum)
    return torch.sqrt(squares / (totals[1] - 1.0))


def masked_whiten(x: Tensor, mask: Tensor, all_sum: AllSum | None = None) -> Tensor:
    """``(x - mean) / sqrt(var + 1e-8)`` with the mean and the unbiased variance over the
    positions where ``mask`` is set, on all ranks (verl's ``masked_whiten``); then masked."""
    m = mask.to(x.dtype)
    totals = _sum(torch.stack([(x * m).sum(), m.sum()]), all_sum)
    count = totals[1]
    if count < 2:
        raise ValueError("masked_whiten: needs at least 2 completion tokens in the batch")
    mean = totals[0] / count
    var = _sum((((x - mean) ** 2) * m).sum(), all_sum) / count * (count / (count - 1.0))
    return (x - mean) * torch.rsqrt(var + 1e-8) * m


def discounted_returns(rewards: Tensor, mask: Tensor, gamma: float = 1.0) -> Tensor:
    """Token returns of an outcome reward placed on each completion's last token: position
    ``t`` of a completion of length ``L`` gets ``gamma ** (L - 1 - t) * r``, padding 0."""
    m = mask.to(rewards.dtype)
    lengths = m.sum(-1, keepdim=True)
    steps_to_end = lengths - 1.0 - torch.arange(m.shape[-1], device=m.device, dtype=m.dtype)
    power = torch.ones_like(m) if gamma == 1.0 else torch.pow(gamma, steps_to_end.clamp(min=0))
    return rewards.unsqueeze(-1) * power * m


def compute_advantages(
    rewards: Tensor,
    num_generations: int,
    *,
    advantage: str = "grpo",
    scale_rewards: str | bool | None = None,
    mask: Tensor | None = None,
    gamma: float = 1.0,
    eps: float = 1e-4,
    all_sum: AllSum | None = None,
) -> Tensor:
    """Advantages of ``rewards`` ``[N]`` (consecutive groups of ``num_generations``): ``[N]``,
    or ``[N, T]`` for the REINFORCE++ estimators (``mask``: the completion tokens ``[N, T]``,
    required for those). See the module docstring for each estimator and scaling."""
    scale = check_advantage_options(advantage, scale_rewards, gamma)
    grouped = rewards.view(-1, num_generations)
    _check_groups(grouped)
    if advantage in PER_TOKEN and mask is None:
        raise ValueError(f"advantage={advantage!r} needs the completion mask")
    if advantage == "grpo":
        if scale == "group":
            return group_advantages(grouped, eps).flatten()
        centred = grouped - grouped.mean(dim=1, keepdim=True)
        if scale == "batch":
            return (centred / (batch_std(rewards, all_sum) + eps)).flatten()
        return centred.flatten()
    if advantage == "rloo":
        others = (grouped.sum(dim=1, keepdim=True) - grouped) / (num_generations - 1)
        adv = (grouped - others).flatten()
        if scale == "batch":
            count = torch.tensor(float(adv.numel()), device=adv.device)
            n = _sum(torch.stack([adv.sum(), count]), all_sum)
            adv = (adv - n[0] / n[1]) / (batch_std(adv, all_sum) + eps)
        return adv
    assert mask is not None
    if advantage == "reinforce_pp":
        returns = discounted_returns(rewards, mask, gamma)
    else:  # reinforce_pp_baseline
        centred = (grouped - grouped.mean(dim=1, keepdim=True)).flatten()
        returns = centred.unsqueeze(-1) * mask.to(rewards.dtype)
    if scale == "none":
        return returns * mask.to(rewards.dtype)
    return masked_whiten(returns, mask, all_sum)
