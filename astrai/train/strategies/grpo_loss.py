"""GRPO's loss as pure functions: group advantages, the k3 KL and the clipped objective with
TRL's four token aggregations (``loss_type``).

The names and formulas follow TRL 1.16 (``GRPOTrainer._compute_loss``), so a researcher can
compare runs across the two frameworks. Per token, with ``r = exp(logp - old_logp)``::

    l = -min(r * A, clamp(r, 1 - epsilon, 1 + epsilon_high) * A) + kl_coef * k3(logp, ref) [* r]

(``* r`` with ``use_bias_correction_kl``, TRL 1.16's default: the k3 estimate weighted by the
importance ratio, since the tokens were sampled by the rollout policy; DeepSeek-V3.2) and the
loss aggregates ``l`` over the completion tokens (``mask``):

- ``grpo``: mean over each sequence's tokens, then mean over sequences (the paper's; favours
  short correct and long wrong completions);
- ``bnpo``: mean over all completion tokens of the (local) batch;
- ``dr_grpo``: sum / (number of sequences * ``max_completion_length``) (Dr. GRPO);
- ``dapo``: sum / number of completion tokens of the *global* batch, i.e. over every rank and
  every accumulated micro-batch of one optimizer step (DAPO; TRL's default). ``num_items`` is
  TRL's normaliser: that global count divided by the number of processes, since DDP averages
  the ranks' gradients.
"""

from __future__ import annotations

import torch
from torch import Tensor

LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo")


def group_advantages(rewards: Tensor, eps: float = 1e-4) -> Tensor:
    """``(r - mean_g) / (std_g + eps)`` within each group: ``[B, G] -> [B, G]``.

    ``std`` is the unbiased sample standard deviation (as in DeepSeekMath / TRL); a group whose
    completions all got the same reward has zero advantage and contributes no policy gradient.
    """
    if rewards.dim() != 2:
        raise ValueError(f"group_advantages: expected [prompts, G], got {tuple(rewards.shape)}")
    if rewards.shape[1] < 2:
        raise ValueError("group_advantages: need at least 2 completions per prompt")
    mean = rewards.mean(dim=1, keepdim=True)
    std = rewards.std(dim=1, keepdim=True)
    return (rewards - mean) / (std + eps)


def k3_kl(logp: Tensor, ref_logp: Tensor) -> Tensor:
    """Per-token k3 estimator of KL(pi || ref): ``exp(ref - pi) - (ref - pi) - 1`` (>= 0,
    unbiased, low variance; Schulman 2020)."""
    diff = ref_logp - logp
    return torch.exp(diff) - diff - 1.0


def check_loss_options(
    loss_type: str, epsilon: float, epsilon_high: float | None
) -> tuple[float, float]:
    """Raise a ValueError naming the bad field; return ``(epsilon_low, epsilon_high)``."""
    if loss_type not in LOSS_TYPES:
        raise ValueError(f"GRPO loss_type must be one of {LOSS_TYPES}, got {loss_type!r}")
    if not 0.0 <= float(epsilon) < 1.0:
        raise ValueError(f"GRPO epsilon must be in [0, 1), got {epsilon}")
    high = float(epsilon if epsilon_high is None else epsilon_high)
    if high < 0.0:
        raise ValueError(f"GRPO epsilon_high must be >= 0 (or null = epsilon), got {epsilon_high}")
    return float(epsilon), high


def _masked_mean(x: Tensor, mask: Tensor) -> Tensor:
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
) -> tuple[Tensor, dict[str, Tensor]]:
    """The clipped-ratio policy loss plus ``kl_coef`` * k3 KL, aggregated as ``loss_type``.

    Args:
        logp: current policy log-probs of the sampled tokens ``[N, T]`` (with grad).
        old_logp: log-probs of the policy that sampled them (the rollout) ``[N, T]``.
        advantages: one per completion ``[N]`` (broadcast over its tokens).
        mask: 1 on completion tokens ``[N, T]``.
        epsilon, epsilon_high: the ratio is clipped to ``[1 - epsilon, 1 + epsilon_high]``
            (``epsilon_high`` None: ``epsilon``; DAPO's "clip-higher" uses 0.28).
        ref_logp: reference log-probs ``[N, T]`` (needed when ``kl_coef > 0``).
        use_bias_correction_kl: weight the per-token k3 by the ratio ``r`` (with gradient).
        max_completion_length: ``dr_grpo``'s constant (the rollout's ``max_new_tokens``).
        num_items: ``dapo``'s normaliser (global completion tokens / number of processes);
            None: this batch's completion tokens.
    Returns:
        the loss and detached metrics (TRL's names): ``kl`` (token mean of k3),
        ``clip_ratio/low_mean`` (tokens with ``r < 1 - epsilon`` and ``A < 0``: the clip is
        active), ``clip_ratio/high_mean`` (``r > 1 + epsilon_high`` and ``A > 0``),
        ``clip_ratio/region_mean`` (either), ``ratio`` (token mean of ``r``).
    """
    eps_low, eps_high = check_loss_options(loss_type, epsilon, epsilon_high)
    mask = mask.to(logp.dtype)
    adv = advantages.to(logp.dtype).unsqueeze(-1)
    ratio = torch.exp(logp - old_logp)
    clipped = torch.clamp(ratio, 1.0 - eps_low, 1.0 + eps_high)
    per_token = -torch.minimum(ratio * adv, clipped * adv)
    metrics: dict[str, Tensor] = {}
    if kl_coef and ref_logp is None:
        raise ValueError("grpo_loss: kl_coef > 0 needs ref_logp")
    if ref_logp is not None:
        kl = k3_kl(logp, ref_logp)
        if use_bias_correction_kl:
            kl = kl * ratio
        if kl_coef:
            per_token = per_token + kl_coef * kl
        metrics["kl"] = _masked_mean(kl, mask)

    masked = per_token * mask
    if loss_type == "grpo":
        loss = (masked.sum(-1) / mask.sum(-1).clamp(min=1.0)).mean()
    elif loss_type == "bnpo":
        loss = masked.sum() / mask.sum().clamp(min=1.0)
    elif loss_type == "dr_grpo":
        if not max_completion_length:
            raise ValueError("grpo_loss: loss_type dr_grpo needs max_completion_length")
        loss = masked.sum() / (per_token.shape[0] * max_completion_length)
    else:  # dapo
        n = mask.sum() if num_items is None else torch.as_tensor(num_items, dtype=logp.dtype)
        loss = masked.sum() / n.clamp(min=1.0)

    low = ((ratio < 1.0 - eps_low) & (adv < 0)).to(logp.dtype)
    high = ((ratio > 1.0 + eps_high) & (adv > 0)).to(logp.dtype)
    metrics["clip_ratio/low_mean"] = _masked_mean(low, mask)
    metrics["clip_ratio/high_mean"] = _masked_mean(high, mask)
    metrics["clip_ratio/region_mean"] = _masked_mean(torch.maximum(low, high), mask)
    metrics["ratio"] = _masked_mean(ratio, mask)
    return loss, metrics
