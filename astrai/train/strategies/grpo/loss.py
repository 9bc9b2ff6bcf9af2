"""GRPO's loss as pure functions: the k3 KL, the high-entropy token mask and the clipped
objective with TRL's four token aggregations (``loss_type``).

The names and formulas follow TRL 1.16 (``GRPOTrainer._compute_loss``), so a researcher can
compare runs across the two frameworks. With the importance weight ``w``: per token
``exp(logp - old_logp)`` (``importance_sampling_level="token"``), or one per sequence,
``exp(mean over its tokens of (logp - old_logp))`` (``"sequence"``, GSPO)::

    l = -min(min(w, delta) * A, clamp(w, 1 - epsilon, 1 + epsilon_high) * A) [* entropy mask]
        + kl_coef * k3(logp, ref) [* w]

(``min(w, delta)`` only with ``delta``, INTELLECT-2's two-sided clipping; the entropy mask
only with ``top_entropy_quantile < 1``; ``* w`` with ``use_bias_correction_kl``, TRL 1.16's
default: the k3 estimate weighted by the importance ratio, since the tokens were sampled by
the rollout policy) and the loss aggregates ``l`` over the completion tokens (``mask``):

- ``grpo``: mean over each sequence's tokens, then mean over sequences (the paper's; favours
  short correct and long wrong completions);
- ``bnpo``: mean over all completion tokens of the (local) batch;
- ``dr_grpo``: sum / (number of sequences * ``max_completion_length``) (Dr. GRPO);
- ``dapo``: sum / number of completion tokens of the *global* batch, i.e. over every rank and
  every accumulated micro-batch of one optimizer step (DAPO; TRL's default). ``num_items`` is
  TRL's normaliser: that global count divided by the number of processes, since DDP averages
  the ranks' gradients.

The newer objectives (``cispo``, ``sapo``, ``gmpo``, ``clip_cov``, ``kl_cov``) are in
:mod:`~astrai.train.strategies.grpo.policy_losses`, each with its aggregation among these
four. ``entropy_coef`` subtracts TRL's entropy bonus (the mean entropy over the acting tokens)
and ``off_policy_mask`` (TRL's ``get_off_policy_mask``) multiplies the policy term.

Advantages come from :mod:`astrai.train.strategies.grpo.advantages`: one per completion
``[N]`` or one per token ``[N, T]`` (REINFORCE++).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import torch
from torch import Tensor

from astrai.train.strategies.grpo.policy_losses import (
    AGGREGATION,
    PolicyLossParams,
    policy_term,
)

#: PPO's clipped objective under TRL's four aggregations (the newer objectives' names are
#: in policy_losses.LOSS_TYPES)
LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo")
IS_LEVELS = ("token", "sequence")
#: TRL's ``vllm_importance_sampling_mode`` values: the off-policy correction's granularity and
#: what happens outside ``[clip_min, clip_max]`` (truncated to it, or masked to 0)
IS_CORRECTIONS = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")


def k3_kl(logp: Tensor, ref_logp: Tensor) -> Tensor:
    """Per-token k3 estimator of KL(pi || ref): ``exp(ref - pi) - (ref - pi) - 1`` (>= 0,
    unbiased, low variance; Schulman 2020)."""
    diff = ref_logp - logp
    return torch.exp(diff) - diff - 1.0


def check_loss_options(
    loss_type: str,
    epsilon: float,
    epsilon_high: float | None,
    *,
    importance_sampling_level: str = "token",
    delta: float | None = None,
    top_entropy_quantile: float = 1.0,
) -> tuple[float, float]:
    """Raise a ValueError naming the bad field; return ``(epsilon_low, epsilon_high)``."""
    if loss_type not in AGGREGATION:
        raise ValueError(f"GRPO loss_type must be one of {tuple(AGGREGATION)}, got {loss_type!r}")
    if not 0.0 <= float(epsilon) < 1.0:
        raise ValueError(f"GRPO epsilon must be in [0, 1), got {epsilon}")
    high = float(epsilon if epsilon_high is None else epsilon_high)
    if high < 0.0:
        raise ValueError(f"GRPO epsilon_high must be >= 0 (or null = epsilon), got {epsilon_high}")
    if importance_sampling_level not in IS_LEVELS:
        raise ValueError(
            f"GRPO importance_sampling_level must be one of {IS_LEVELS}, "
            f"got {importance_sampling_level!r}"
        )
    if delta is not None and not float(delta) > 1.0 + high:
        raise ValueError(
            f"GRPO delta (the two-sided clip's upper bound on the ratio) must be > 1 + "
            f"epsilon_high = {1.0 + high:g}, or null, got {delta}"
        )
    if not 0.0 <= float(top_entropy_quantile) <= 1.0:
        raise ValueError(
            f"GRPO top_entropy_quantile must be in [0, 1] (1: every token), got "
            f"{top_entropy_quantile}"
        )
    return float(epsilon), high


def high_entropy_mask(
    entropies: Tensor,
    mask: Tensor,
    top_entropy_quantile: float,
    gather: Callable[[Tensor], Tensor] | None = None,
) -> Tensor:
    """TRL's ``get_high_entropy_mask``: keep the completion tokens whose entropy is at least
    the ``1 - top_entropy_quantile`` quantile of every completion token's entropy (all ranks:
    ``gather`` concatenates a tensor over them; None: this process only). "Beyond the 80/20
    rule" trains on the top 20% (``top_entropy_quantile=0.2``)."""
    local = entropies[mask.bool()].float()
    pooled = gather(local) if gather is not None else local
    if pooled.numel() == 0:
        return torch.zeros_like(mask, dtype=torch.bool)
    threshold = torch.quantile(pooled, 1.0 - float(top_entropy_quantile))
    return ((entropies * mask.to(entropies.dtype)) >= threshold) & mask.bool()


def importance_sampling_ratio(
    old_logp: Tensor,
    behaviour_logp: Tensor,
    mask: Tensor,
    *,
    mode: str = "token_truncate",
    clip_min: float | None = None,
    clip_max: float | None = 3.0,
) -> Tensor:
    """TRL's ``importance_sampling_ratio`` (``vllm_importance_sampling_correction``): the
    weight of each sampled token (``[N, T]``, ``token_*`` modes) or sequence (``[N, 1]``,
    ``sequence_*``: the exponentiated *sum* of its tokens' log-ratios) between the policy the
    loss treats as ``old`` and the one that sampled (``behaviour``): an older one under
    asynchronous rollouts. ``*_truncate`` clamps it to ``[clip_min, clip_max]``; ``*_mask``
    sets weights outside that range to 0. No gradient flows through it."""
    if mode not in IS_CORRECTIONS:
        raise ValueError(f"importance sampling mode must be one of {IS_CORRECTIONS}, got {mode!r}")
    diff = ((old_logp - behaviour_logp) * mask).detach()
    if mode.startswith("sequence"):
        diff = diff.sum(-1, keepdim=True)
    ratio = torch.exp(diff)
    if mode.endswith("truncate"):
        if clip_min is None and clip_max is None:
            return ratio
        return torch.clamp(ratio, min=clip_min, max=clip_max)
    low = -math.inf if clip_min is None else clip_min
    high = math.inf if clip_max is None else clip_max
    return ratio.masked_fill((ratio < low) | (ratio > high), 0.0)


def _masked_mean(x: Tensor, mask: Tensor) -> Tensor:
    if x.shape[-1] == 1:  # one value per sequence (importance_sampling_level="sequence")
        return x.mean().detach()
    return ((x * mask).sum() / mask.sum().clamp(min=1.0)).detach()


def grpo_loss(
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    loss_type: str = "dapo",
    epsilon: float = 0.2,
    epsilon_high: float | None = None,
    ref_logp: Tensor | None = None,
    kl_coef: float = 0.0,
    use_bias_correction_kl: bool = False,
    max_completion_length: int | None = None,
    num_items: float | Tensor | None = None,
    importance_sampling_level: str = "token",
    delta: float | None = None,
    entropy_mask: Tensor | None = None,
    is_weight: Tensor | None = None,
    params: PolicyLossParams | None = None,
    entropies: Tensor | None = None,
    entropy_coef: float = 0.0,
    entropy_scale: float | Tensor = 1.0,
    off_policy_mask: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """The policy loss of ``loss_type`` plus ``kl_coef`` * k3 KL, aggregated as ``loss_type``
    says (:data:`~astrai.train.strategies.grpo.policy_losses.AGGREGATION`).

    Args:
        logp: current policy log-probs of the sampled tokens ``[N, T]`` (with grad).
        old_logp: log-probs of the policy that sampled them (the rollout) ``[N, T]``.
        advantages: one per completion ``[N]`` (broadcast over its tokens) or per token
            ``[N, T]``.
        mask: 1 on completion tokens ``[N, T]`` (0 on truncated completions with
            ``mask_truncated_completions``).
        epsilon, epsilon_high: the ratio is clipped to ``[1 - epsilon, 1 + epsilon_high]``
            (``epsilon_high`` None: ``epsilon``; DAPO's "clip-higher" uses 0.28; ``cispo``:
            ``epsilon_high`` is eps_max, the weight's upper bound).
        ref_logp: reference log-probs ``[N, T]`` (needed when ``kl_coef > 0``).
        use_bias_correction_kl: weight the per-token k3 by the importance weight.
        max_completion_length: ``dr_grpo``'s constant (the rollout's ``max_new_tokens``).
        num_items: ``dapo``'s normaliser (global completion tokens / number of processes);
            None: this batch's completion tokens.
        importance_sampling_level: ``token`` (one weight per token) or ``sequence`` (GSPO: the
            exponentiated mean log-ratio of each sequence).
        delta: two-sided clipping (INTELLECT-2): the unclipped term's weight is capped at
            ``delta`` (> 1 + epsilon_high), so a negative advantage cannot blow up.
        entropy_mask: bool ``[N, T]`` (:func:`high_entropy_mask`): only these tokens carry
            the policy term; the KL term keeps every completion token (as TRL).
        is_weight: the off-policy correction (:func:`importance_sampling_ratio`, ``[N, T]`` or
            ``[N, 1]``) multiplying the policy term, not the KL (as TRL).
        params: the newer objectives' parameters (epsilon, epsilon_high and delta above win).
        entropies, entropy_coef: TRL's entropy bonus: ``loss - entropy_coef * H`` with ``H``
            the mean of ``entropies`` over the completion tokens (and ``entropy_mask``'s);
            ``entropy_scale`` multiplies it (the dapo normaliser's deferral).
        off_policy_mask: TRL's off-policy sequence mask
            (:func:`~astrai.train.strategies.grpo.policy_losses.off_policy_mask`) multiplying
            the policy term.
    Returns:
        the loss and detached metrics (TRL's names): ``kl`` (token mean of k3),
        ``clip_ratio/low_mean`` (tokens, or sequences at the sequence level, whose clip is
        active with ``A < 0``), ``clip_ratio/high_mean`` (with ``A > 0``; ``cispo``: the
        weight capped at eps_max; ``clip_cov``: also the covariance-selected tokens),
        ``clip_ratio/region_mean`` (either) for the objectives that clip, ``ratio`` (mean
        of ``w``).
    """
    eps_low, eps_high = check_loss_options(
        loss_type, epsilon, epsilon_high, importance_sampling_level=importance_sampling_level
    )
    params = dataclasses.replace(
        params or PolicyLossParams(), epsilon=eps_low, epsilon_high=eps_high, delta=delta
    )
    mask = mask.to(logp.dtype)
    adv = advantages.to(logp.dtype)
    if adv.dim() == 1:
        adv = adv.unsqueeze(-1)
    log_ratio = logp - old_logp
    if importance_sampling_level == "sequence":
        log_ratio = ((log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).unsqueeze(-1)
    ratio = torch.exp(log_ratio)
    metrics: dict[str, Tensor] = {}
    if kl_coef and ref_logp is None:
        raise ValueError("grpo_loss: kl_coef > 0 needs ref_logp")
    kl = None
    if ref_logp is not None:
        kl = k3_kl(logp, ref_logp)
        if use_bias_correction_kl:
            kl = kl * ratio
        metrics["kl"] = _masked_mean(kl, mask)

    term = policy_term(loss_type, logp, old_logp, log_ratio, adv, mask, params)
    per_token = term.loss
    if off_policy_mask is not None:
        per_token = per_token * off_policy_mask.to(per_token.dtype)
    if entropy_mask is not None:
        per_token = per_token * entropy_mask.to(per_token.dtype)
    if is_weight is not None:
        per_token = per_token * is_weight.to(per_token.dtype)
    if kl is not None and kl_coef:
        per_token = per_token + kl_coef * kl
    per_token = per_token.expand_as(mask)  # a sequence-level term with no KL is [N, 1]

    masked = per_token * mask
    aggregation = AGGREGATION[loss_type]
    if aggregation == "grpo":
        loss = (masked.sum(-1) / mask.sum(-1).clamp(min=1.0)).mean()
    elif aggregation == "bnpo":
        loss = masked.sum() / mask.sum().clamp(min=1.0)
    elif aggregation == "dr_grpo":
        if not max_completion_length:
            raise ValueError("grpo_loss: loss_type dr_grpo needs max_completion_length")
        loss = masked.sum() / (per_token.shape[0] * max_completion_length)
    else:  # dapo
        n = mask.sum() if num_items is None else torch.as_tensor(num_items, dtype=logp.dtype)
        loss = masked.sum() / n.clamp(min=1.0)

    if entropies is not None and entropy_coef:
        acting = mask if entropy_mask is None else mask * entropy_mask.to(mask.dtype)
        bonus = (entropies * acting).sum() / acting.sum().clamp(min=1.0)
        metrics["entropy_bonus"] = bonus.detach()
        loss = loss - entropy_coef * entropy_scale * bonus
    if off_policy_mask is not None:
        metrics["off_policy_masked"] = 1.0 - off_policy_mask.float().mean().detach()
    if term.low is not None and term.high is not None:
        low, high = term.low.to(logp.dtype), term.high.to(logp.dtype)
        metrics["clip_ratio/low_mean"] = _masked_mean(low, mask)
        metrics["clip_ratio/high_mean"] = _masked_mean(high, mask)
        metrics["clip_ratio/region_mean"] = _masked_mean(torch.maximum(low, high), mask)
    elif term.high is not None:
        metrics["clip_ratio/high_mean"] = _masked_mean(term.high.to(logp.dtype), mask)
    metrics["ratio"] = _masked_mean(ratio, mask)
    return loss, metrics
