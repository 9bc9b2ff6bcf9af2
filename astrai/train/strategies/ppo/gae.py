"""PPO's advantages: token rewards, generalised advantage estimation and the returns.

verl's definitions and names (``verl/trainer/ppo/core_algos.py``): the outcome reward sits on
the last completion token (an action token: the last 1 of the mask); with
``use_kl_in_reward`` (verl's ``apply_kl_penalty``) every completion token also gets
``-kl_coef * kl``, the KL of the rollout policy to the reference by the ``kl_penalty``
estimator. GAE (Schulman et al. 2016, ``compute_gae_advantage_return``) runs backwards over
the completion with ``gamma`` and ``lam``, skipping tokens off the mask (a multi-turn
episode's environment tokens) so that the TD error links one action to the next; the returns
are ``advantages + values`` before whitening, and the advantages are whitened over every
completion token of the generation batch (all ranks), verl's ``masked_whiten``.

Tensors are completion-aligned ``[N, T]``: column ``t`` is completion token ``t``.
"""

from __future__ import annotations

import torch
from torch import Tensor

from astrai.train.strategies.grpo.advantages import AllSum, masked_whiten

#: verl's ``kl_penalty`` estimators of KL(rollout policy || reference) per token
KL_PENALTIES = ("kl", "abs", "mse", "low_var_kl")


def kl_penalty(logp: Tensor, ref_logp: Tensor, kind: str) -> Tensor:
    """verl's ``kl_penalty_forward``: ``kl`` (k1, ``logp - ref``), ``abs`` (``|k1|``),
    ``mse`` (k2, ``(logp - ref)**2 / 2``) or ``low_var_kl`` (k3, clamped as verl clamps)."""
    if kind == "kl":
        return logp - ref_logp
    if kind == "abs":
        return (logp - ref_logp).abs()
    if kind == "mse":
        return 0.5 * (logp - ref_logp).square()
    if kind == "low_var_kl":
        kl = torch.clamp(ref_logp - logp, min=-20, max=20)
        return torch.clamp(torch.exp(kl) - kl - 1, min=-10, max=10)
    raise ValueError(f"PPO kl_penalty must be one of {KL_PENALTIES}, got {kind!r}")


def token_level_rewards(
    rewards: Tensor, mask: Tensor, kl: Tensor | None = None, kl_coef: float = 0.0
) -> Tensor:
    """``[N, T]``: each completion's outcome reward ``rewards`` ``[N]`` on its last action
    token (the last 1 of ``mask``; none: dropped), minus ``kl_coef * kl`` on every action
    token when ``kl`` is given (verl's ``token_level_scores - beta * kld``)."""
    m = mask.to(rewards.dtype)
    positions = torch.arange(m.shape[-1], device=m.device, dtype=m.dtype)
    last = (positions * m).argmax(dim=-1, keepdim=True)  # the last set position
    has = m.sum(-1, keepdim=True) > 0
    out = torch.zeros_like(m).scatter(-1, last, rewards.unsqueeze(-1) * has.to(m.dtype))
    if kl is not None:
        out = out - kl_coef * kl.to(m.dtype) * m
    return out


def gae_advantage_return(
    token_rewards: Tensor,
    values: Tensor,
    mask: Tensor,
    gamma: float,
    lam: float,
    all_sum: AllSum | None = None,
) -> tuple[Tensor, Tensor]:
    """``(advantages, returns)`` ``[N, T]`` of GAE(``gamma``, ``lam``) on ``token_rewards``
    and the critic's ``values`` (no gradient): the recursion of verl's
    ``compute_gae_advantage_return``, the advantages then whitened over the masked tokens of
    every rank (``all_sum``; None: this process) and zeroed off the mask."""
    with torch.no_grad():
        m = mask.to(values.dtype)
        next_values = torch.zeros_like(values[:, 0])
        last_gae = torch.zeros_like(values[:, 0])
        reversed_adv = []
        for t in reversed(range(token_rewards.shape[-1])):
            delta = token_rewards[:, t] + gamma * next_values - values[:, t]
            gae = delta + gamma * lam * last_gae
            next_values = values[:, t] * m[:, t] + (1 - m[:, t]) * next_values
            last_gae = gae * m[:, t] + (1 - m[:, t]) * last_gae
            reversed_adv.append(last_gae)
        advantages = torch.stack(reversed_adv[::-1], dim=1)
        returns = advantages + values
        return masked_whiten(advantages, m, all_sum), returns
