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

from collections.abc import Callable, Mapping, Sequence
from typing import Any

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


#: ``multi_objective_aggregation`` (TRL's values); ``reward_aggregation`` (the issue's) spells
#: ``sum_then_normalize`` as ``sum``
AGGREGATIONS = ("sum_then_normalize", "normalize_then_sum")
_ISSUE_NAMES = {"sum": "sum_then_normalize", "normalize_then_sum": "normalize_then_sum"}


def check_aggregation(
    multi_objective_aggregation: str | None,
    reward_aggregation: str | None,
    advantage: str,
    scale_rewards: str,
) -> str:
    """The resolved aggregation of several rewards (TRL's name; default
    ``sum_then_normalize``); a ValueError names the key. GDPO (``normalize_then_sum``)
    normalises each reward within its group, sums them weighted and normalises over the
    batch: it is GRPO's group scaling, so it needs ``advantage: grpo`` and
    ``scale_rewards: group``."""
    ours = multi_objective_aggregation
    if ours is not None and ours not in AGGREGATIONS:
        raise ValueError(
            f"GRPO multi_objective_aggregation must be one of {AGGREGATIONS}, got {ours!r}"
        )
    if reward_aggregation is not None:
        if reward_aggregation not in _ISSUE_NAMES:
            raise ValueError(
                f"GRPO reward_aggregation must be one of {tuple(_ISSUE_NAMES)}, "
                f"got {reward_aggregation!r}"
            )
        theirs = _ISSUE_NAMES[reward_aggregation]
        if ours is not None and ours != theirs:
            raise ValueError(
                f"GRPO reward_aggregation={reward_aggregation!r} and "
                f"multi_objective_aggregation={ours!r} disagree: set one of them"
            )
        ours = theirs
    ours = ours or "sum_then_normalize"
    if ours == "normalize_then_sum" and (advantage != "grpo" or scale_rewards != "group"):
        raise ValueError(
            "GRPO multi_objective_aggregation=normalize_then_sum (GDPO) normalises each reward "
            "in its group and the sum over the batch: it needs advantage=grpo and "
            f"scale_rewards=group, got advantage={advantage!r}, scale_rewards={scale_rewards!r}"
        )
    return ours


def gdpo_advantages(
    columns: Tensor,
    weights: Tensor,
    num_generations: int,
    eps: float = 1e-4,
    all_sum: AllSum | None = None,
) -> Tensor:
    """GDPO (TRL 1.16's ``normalize_then_sum``): each reward column of ``columns`` ``[N, K]``
    normalised within its group (unbiased std), summed with ``weights`` ``[K]``, then the
    sum normalised over the whole batch (all ranks): ``[N]``."""
    k = columns.shape[1]
    grouped = columns.view(-1, num_generations, k)
    _check_groups(grouped[..., 0])
    mean_k = grouped.mean(dim=1, keepdim=True)
    std_k = grouped.std(dim=1, keepdim=True)
    normalised = ((grouped - mean_k) / (std_k + eps)).view(-1, k)
    rewards = (normalised * weights.to(columns).unsqueeze(0)).sum(dim=1)
    count = torch.tensor(float(rewards.numel()), device=rewards.device)
    totals = _sum(torch.stack([rewards.sum(), count]), all_sum)
    return (rewards - totals[0] / totals[1]) / (batch_std(rewards, all_sum) + eps)


def aggregated_advantages(
    rewards: Tensor,
    columns: Mapping[str, Sequence[float]],
    weights: Mapping[str, float],
    num_generations: int,
    *,
    aggregation: str = "sum_then_normalize",
    eps: float = 1e-4,
    all_sum: AllSum | None = None,
    **estimator: Any,
) -> Tensor:
    """The advantages of a generation batch: of the weighted total ``rewards`` ``[N]`` by the
    estimator (``sum_then_normalize``), or GDPO's of the reward ``columns`` by name
    (``normalize_then_sum``; a column without a weight, e.g. ``environment``, weighs 1)."""
    if aggregation == "normalize_then_sum":
        names = list(columns)
        matrix = torch.tensor([list(columns[n]) for n in names], dtype=rewards.dtype).T
        w = torch.tensor([float(weights.get(n, 1.0)) for n in names], dtype=rewards.dtype)
        return gdpo_advantages(matrix.to(rewards.device), w, num_generations, eps, all_sum)
    return compute_advantages(rewards, num_generations, eps=eps, all_sum=all_sum, **estimator)
