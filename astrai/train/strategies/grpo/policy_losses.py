"""GRPO's per-token policy objectives as a registry (verl ``core_algos``' ``register_policy_loss``
style): each ``loss_type`` maps to a function giving the policy term per token (or per
sequence, ``[N, 1]``) and which tokens its clipping touched, and to the aggregation
:func:`~astrai.train.strategies.grpo.loss.grpo_loss` applies to it.

With ``w = exp(logp - old_logp)`` (per token, or GSPO's per sequence) and advantage ``A``:

- ``grpo`` / ``bnpo`` / ``dr_grpo`` / ``dapo``: PPO's clip, ``-min(w A, clamp(w, 1-eps,
  1+eps_high) A)`` (TRL); the name is also the aggregation.
- ``cispo`` (ScaleRL / MiniMax-M1, TRL): ``-sg(min(w, epsilon_high)) * A * logp``: the weight
  is clipped and detached, so every token keeps a gradient; ``epsilon_high`` is eps_max
  (TRL recommends 5.0). Aggregated as ``dapo`` (TRL).
- ``sapo`` (Soft Adaptive Policy Optimization, TRL): ``-sigmoid(tau (w - 1)) * 4 / tau * A``
  with ``tau = sapo_temperature_pos`` when ``A > 0``, else ``sapo_temperature_neg``.
  Aggregated as ``grpo`` (TRL).
- ``gmpo`` (verl ``geo_mean``, GMPO): per sequence ``-mean_A * exp(mean over its tokens of
  the sign-aware clipped log-ratio)``, the log-ratio clipped to ``[-epsilon, epsilon_high]``;
  one value per sequence, averaged over sequences (verl's ``torch.mean``: ``grpo``).
- ``clip_cov`` (Clip-Cov, verl): PPO's clip, plus the gradient of up to ``clip_cov_ratio`` of
  the tokens whose ``cov = (A - mean A)(logp - mean logp)`` lies in ``(clip_cov_lb,
  clip_cov_ub)`` (and which the clip left alone) set to zero; verl picks them at random,
  here by a permutation seeded from ``seed`` (replayable). Aggregated as ``dapo`` (verl's
  ``token-mean`` over the global batch).
- ``kl_cov`` (KL-Cov, verl): ``-w A``, plus ``ppo_kl_coef * |logp - old_logp|`` on the top
  ``kl_cov_ratio`` of tokens by that covariance. Aggregated as ``dapo`` (verl's ``token-mean``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

#: each loss_type's aggregation (grpo_loss's four: grpo, bnpo, dr_grpo, dapo)
AGGREGATION = {
    "grpo": "grpo",
    "bnpo": "bnpo",
    "dr_grpo": "dr_grpo",
    "dapo": "dapo",
    "cispo": "dapo",
    "sapo": "grpo",
    "gmpo": "grpo",
    "geo_mean": "grpo",
    "clip_cov": "dapo",
    "kl_cov": "dapo",
}
LOSS_TYPES = tuple(AGGREGATION)
#: objectives whose ratio is a token's own (no GSPO sequence ratio)
TOKEN_LEVEL_ONLY = ("cispo", "gmpo", "geo_mean", "clip_cov", "kl_cov")


def global_token_normalised(loss_type: str) -> bool:
    """Whether ``loss_type`` divides by the completion tokens of the whole optimizer step."""
    return AGGREGATION[loss_type] == "dapo"


@dataclass(frozen=True)
class PolicyLossParams:
    """The objectives' parameters (TRL's names, verl's where TRL has none)."""

    epsilon: float = 0.2
    epsilon_high: float = 0.2
    delta: float | None = None
    sapo_temperature_pos: float = 1.0
    sapo_temperature_neg: float = 1.05
    clip_cov_ratio: float = 0.0002
    clip_cov_lb: float = 1.0
    clip_cov_ub: float = 5.0
    kl_cov_ratio: float = 0.0002
    ppo_kl_coef: float = 1.0
    seed: int = 0


@dataclass(frozen=True)
class PolicyTerm:
    """A policy objective's per-token (``[N, T]``) or per-sequence (``[N, 1]``) loss, and the
    tokens its clip touched (``low``: ``A < 0``, ``high``: ``A > 0``; None: no clip)."""

    loss: Tensor
    low: Tensor | None = None
    high: Tensor | None = None


# (logp, old_logp, log_ratio, advantages [N, 1] or [N, T], mask, params) -> PolicyTerm
PolicyLossFn = Callable[[Tensor, Tensor, Tensor, Tensor, Tensor, PolicyLossParams], PolicyTerm]
POLICY_LOSSES: dict[str, PolicyLossFn] = {}


def register_policy_loss(*names: str) -> Callable[[PolicyLossFn], PolicyLossFn]:
    def add(fn: PolicyLossFn) -> PolicyLossFn:
        for name in names:
            POLICY_LOSSES[name] = fn
        return fn

    return add


def policy_term(
    loss_type: str,
    logp: Tensor,
    old_logp: Tensor,
    log_ratio: Tensor,
    adv: Tensor,
    mask: Tensor,
    params: PolicyLossParams,
) -> PolicyTerm:
    """``loss_type``'s policy term (``log_ratio``: per token, or ``[N, 1]`` at GSPO's level)."""
    return POLICY_LOSSES[loss_type](logp, old_logp, log_ratio, adv, mask, params)


def _clip_flags(ratio: Tensor, adv: Tensor, low: float, high: float) -> tuple[Tensor, Tensor]:
    return (ratio < low) & (adv < 0), (ratio > high) & (adv > 0)


@register_policy_loss("grpo", "bnpo", "dr_grpo", "dapo")
def ppo_clip(logp, old_logp, log_ratio, adv, mask, p: PolicyLossParams) -> PolicyTerm:
    ratio = torch.exp(log_ratio)
    clipped = torch.clamp(ratio, 1.0 - p.epsilon, 1.0 + p.epsilon_high)
    capped = ratio if p.delta is None else torch.clamp(ratio, max=float(p.delta))
    low, high = _clip_flags(capped, adv, 1.0 - p.epsilon, 1.0 + p.epsilon_high)
    return PolicyTerm(-torch.minimum(capped * adv, clipped * adv), low, high)


@register_policy_loss("cispo")
def cispo(logp, old_logp, log_ratio, adv, mask, p: PolicyLossParams) -> PolicyTerm:
    ratio = torch.exp(log_ratio)
    weight = torch.clamp(ratio, max=p.epsilon_high).detach()
    return PolicyTerm(-weight * adv * logp, None, (ratio > p.epsilon_high) & (adv > 0))


@register_policy_loss("sapo")
def sapo(logp, old_logp, log_ratio, adv, mask, p: PolicyLossParams) -> PolicyTerm:
    ratio = torch.exp(log_ratio)
    tau = torch.where(adv > 0, p.sapo_temperature_pos, p.sapo_temperature_neg).to(ratio.dtype)
    return PolicyTerm(-torch.sigmoid(tau * (ratio - 1.0)) * 4.0 / tau * adv)


def _masked_mean(x: Tensor, mask: Tensor) -> Tensor:
    return (x * mask).sum() / mask.sum().clamp(min=1.0)


@register_policy_loss("gmpo", "geo_mean")
def gmpo(logp, old_logp, log_ratio, adv, mask, p: PolicyLossParams) -> PolicyTerm:
    adv = adv.expand_as(log_ratio)
    sign = torch.sign(adv)
    clamped = torch.clamp(log_ratio, -p.epsilon, p.epsilon_high)
    kept = sign * torch.minimum(sign * log_ratio, sign * clamped)
    count = mask.sum(-1) + 1e-8
    seq_ratio = torch.exp((kept * mask).sum(-1) / count)
    seq_adv = (adv * mask).sum(-1) / count
    clipped = log_ratio != clamped
    return PolicyTerm(
        (-seq_adv * seq_ratio).unsqueeze(-1), clipped & (adv < 0), clipped & (adv > 0)
    )


def _covariance(adv: Tensor, logp: Tensor, mask: Tensor) -> Tensor:
    """Each token's ``(A - mean A)(logp - mean logp)`` over the completion tokens (detached)."""
    adv, logp = adv.detach().expand_as(logp), logp.detach()
    return (adv - _masked_mean(adv, mask)) * (logp - _masked_mean(logp, mask))


@register_policy_loss("clip_cov")
def clip_cov(logp, old_logp, log_ratio, adv, mask, p: PolicyLossParams) -> PolicyTerm:
    ratio = torch.exp(log_ratio)
    adv = adv.expand_as(ratio)
    plain = -adv * ratio
    clipped = -adv * torch.clamp(ratio, 1.0 - p.epsilon, 1.0 + p.epsilon_high)
    valid = mask > 0
    by_clip = (clipped > plain) & valid
    cov = _covariance(adv, logp, mask)
    candidates = (cov < p.clip_cov_ub) & (cov > p.clip_cov_lb) & valid & ~by_clip
    where = torch.nonzero(candidates)
    count = max(int(p.clip_cov_ratio * float(mask.sum())), 1)
    if len(where) > count:
        generator = torch.Generator().manual_seed(int(p.seed))
        where = where[torch.randperm(len(where), generator=generator)[:count].to(where.device)]
    keep = torch.ones_like(ratio)
    keep[where[:, 0], where[:, 1]] = 0.0
    low, high = _clip_flags(ratio, adv, 1.0 - p.epsilon, 1.0 + p.epsilon_high)
    return PolicyTerm(torch.maximum(plain, clipped) * keep, low, high | (keep == 0))


@register_policy_loss("kl_cov")
def kl_cov(logp, old_logp, log_ratio, adv, mask, p: PolicyLossParams) -> PolicyTerm:
    ratio = torch.exp(log_ratio)
    adv = adv.expand_as(ratio)
    loss = -adv * ratio
    valid = (mask > 0).reshape(-1)
    flat_idx = torch.nonzero(valid, as_tuple=True)[0]
    if len(flat_idx):
        cov = _covariance(adv, logp, mask).reshape(-1)[flat_idx]
        count = max(1, int(len(flat_idx) * p.kl_cov_ratio))
        top = flat_idx[torch.topk(cov, count, largest=True).indices]
        penalty = torch.zeros_like(loss).reshape(-1)
        penalty[top] = 1.0
        loss = loss + penalty.view_as(loss) * p.ppo_kl_coef * log_ratio.abs()
    return PolicyTerm(loss)


def check_policy_loss_options(
    loss_type: str,
    *,
    importance_sampling_level: str = "token",
    sapo_temperature_pos: float = 1.0,
    sapo_temperature_neg: float = 1.05,
    clip_cov_ratio: float = 0.0002,
    clip_cov_lb: float = 1.0,
    clip_cov_ub: float = 5.0,
    kl_cov_ratio: float = 0.0002,
    ppo_kl_coef: float = 1.0,
    entropy_coef: float = 0.0,
    off_policy_mask_threshold: float | None = None,
) -> None:
    """Raise a ValueError naming the bad key of the newer objectives' options."""
    if loss_type not in LOSS_TYPES:
        raise ValueError(f"GRPO loss_type must be one of {LOSS_TYPES}, got {loss_type!r}")
    if loss_type in TOKEN_LEVEL_ONLY and importance_sampling_level != "token":
        raise ValueError(
            f"GRPO importance_sampling_level={importance_sampling_level!r} does not apply to "
            f"loss_type {loss_type!r} (a per-token objective; GSPO: loss_type grpo)"
        )
    for name, value in (
        ("sapo_temperature_pos", sapo_temperature_pos),
        ("sapo_temperature_neg", sapo_temperature_neg),
    ):
        if not float(value) > 0.0:
            raise ValueError(f"GRPO {name} must be > 0, got {value}")
    for name, value in (("clip_cov_ratio", clip_cov_ratio), ("kl_cov_ratio", kl_cov_ratio)):
        if not 0.0 < float(value) <= 1.0:
            raise ValueError(f"GRPO {name} must be in (0, 1], got {value}")
    if not float(clip_cov_lb) < float(clip_cov_ub):
        raise ValueError(
            f"GRPO clip_cov_lb must be < clip_cov_ub, got {clip_cov_lb} and {clip_cov_ub}"
        )
    if not float(ppo_kl_coef) >= 0.0:
        raise ValueError(f"GRPO ppo_kl_coef must be >= 0, got {ppo_kl_coef}")
    if not float(entropy_coef) >= 0.0:
        raise ValueError(f"GRPO entropy_coef must be >= 0, got {entropy_coef}")
    if off_policy_mask_threshold is not None and not float(off_policy_mask_threshold) > 0.0:
        raise ValueError(
            f"GRPO off_policy_mask_threshold must be > 0 or null, got {off_policy_mask_threshold}"
        )


def off_policy_mask(
    advantages: Tensor, logp: Tensor, sampling_logp: Tensor, mask: Tensor, threshold: float
) -> Tensor:
    """TRL's ``get_off_policy_mask`` (DeepSeek-V3.2's off-policy sequence mask): ``[N, 1]``,
    0 for a sequence with a negative advantage whose mean ``sampling_logp - logp`` over its
    tokens exceeds ``threshold``, else 1."""
    kl = torch.nan_to_num(sampling_logp - logp.detach(), nan=0.0)
    mean_kl = (kl * mask).sum(-1, keepdim=True) / mask.sum(-1, keepdim=True).clamp(min=1.0)
    adv = advantages if advantages.dim() == 2 else advantages.unsqueeze(-1)
    return ((adv >= 0) | (mean_kl <= threshold)).to(mask.dtype)
