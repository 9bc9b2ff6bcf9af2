"""The losses and metrics of preference batches (``chosen_*`` / ``rejected_*``, see
``PreferenceDataset``) that every preference strategy shares (DPO and its loss family, CPO and
SimPO, ORPO, the reward model): one home, so no strategy imports another. Their log-probs
(`preference_logprobs`, `sequence_logprobs`, `reward_inputs`, ...) live in
``astrai.likelihood``, below training, where ``astrai.eval.preference`` reads them too; they
are imported here for the strategies."""

from __future__ import annotations

from collections.abc import Mapping

import torch.nn.functional as F
from torch import Tensor

from astrai.likelihood import (
    REDUCTIONS,
    ld_masks,
    preference_logprobs,
    preference_token_logprobs,
    reduce_preference,
    reward_inputs,
    sequence_logprobs,
)

__all__ = [
    "REDUCTIONS",
    "chosen_nll",
    "ld_masks",
    "preference_logprobs",
    "preference_metrics",
    "preference_token_logprobs",
    "reduce_preference",
    "response_nll",
    "reward_inputs",
    "sequence_logprobs",
    "smoothed_sigmoid_loss",
]


def smoothed_sigmoid_loss(z: Tensor, eps: float) -> Tensor:
    """``-(1-eps) log sig(z) - eps log sig(-z)``: the logistic preference loss of margin
    ``z`` with the label flipped at rate ``eps`` (cDPO's label smoothing; 0: plain)."""
    loss = -(1.0 - eps) * F.logsigmoid(z)
    return loss - eps * F.logsigmoid(-z) if eps else loss


def response_nll(token_logps: Tensor, mask: Tensor) -> Tensor:
    """Mean negative log-likelihood per response token over all rows (0 when none)."""
    mask = mask.to(token_logps.dtype)
    return -(token_logps * mask).sum() / mask.sum().clamp(min=1.0)


def chosen_nll(policy_chosen: Tensor, batch: Mapping[str, Tensor], reduction: str) -> Tensor:
    """Mean negative log-likelihood per chosen response token over the batch (TRL's RPO
    ``nll_loss``), from the chosen sequence log-probs of :func:`preference_logprobs`
    (summed or averaged; not LD-weighted)."""
    counts = (batch["chosen_loss_mask"].bool() & (batch["chosen_labels"] != -100)).sum(-1)
    counts = counts.to(policy_chosen.dtype)
    total = policy_chosen.sum() if reduction == "sum" else (policy_chosen * counts).sum()
    return -total / counts.sum().clamp(min=1.0)


def preference_metrics(
    chosen_rewards: Tensor, rejected_rewards: Tensor, policy_chosen: Tensor, policy_rejected: Tensor
) -> dict[str, Tensor]:
    """What preference runs are usually judged by: reward accuracy and margin (the rewards
    are each method's own implicit ones)."""
    return {
        "rewards/chosen": chosen_rewards.mean(),
        "rewards/rejected": rejected_rewards.mean(),
        "rewards/accuracy": (chosen_rewards > rejected_rewards).float().mean(),
        "rewards/margin": (chosen_rewards - rejected_rewards).mean(),
        "logps/chosen": policy_chosen.detach().mean(),
        "logps/rejected": policy_rejected.detach().mean(),
    }
