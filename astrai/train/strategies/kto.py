"""Kahneman-Tversky optimisation (KTO, Ethayarajh et al. 2024, arXiv:2402.01306), TRL's
``KTOTrainer``.

KTO learns from *unpaired* feedback: each example is one completion with a thumbs up
(desirable) or down (undesirable), no rejected twin needed. With the implicit reward
``r = pi - ref`` (summed response log-probs of the policy and a frozen reference) and a
reference point ``z`` (the policy's KL to the reference, estimated on the batch)::

    desirable:    loss = w_d * (1 - sigmoid(beta * (r - z)))
    undesirable:  loss = w_u * (1 - sigmoid(beta * (z - r)))

averaged over all the examples of the batch (``desirable_weight`` ``w_d`` and
``undesirable_weight`` ``w_u`` counter unequal amounts of each). ``z`` is
``mean(pi(y'|x) - ref(y'|x))`` over *mismatched* pairs: each prompt with the completion of
the previous row of the batch (``UnpairedDataset``'s ``kl_`` rows), computed without gradient,
averaged over the ranks, then clamped at 0, as TRL does, in training and in validation alike.

``loss_type: apo_zero_unpaired`` is the unpaired APO-zero loss (D'Oosterlinck et al. 2024,
arXiv:2408.06266): no reference point (``z`` is not estimated), desirable completions are
pushed up, ``1 - sigmoid(beta * r)``, undesirable ones down, ``sigmoid(beta * r)``.

Logged, TRL's names: ``kl``, ``rewards/chosen`` and ``rewards/rejected`` (mean ``beta * r``
of the desirable and undesirable rows), ``rewards/margins``, ``logps/chosen`` and
``logps/rejected`` (mean ``pi``), each only when the batch has such rows, and
``count/chosen``, ``count/rejected`` (rows of each in the batch).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from astrai.data.datasets import IGNORE_INDEX
from astrai.likelihood import CHUNKED, LogitsHead
from astrai.train.module import LMModule, ReferencePolicy
from astrai.train.preference import sequence_logprobs

log = logging.getLogger(__name__)

LOSS_TYPES = ("kto", "apo_zero_unpaired")


# ---------------------------------------------------------------------------- pure functions


def completion_logprobs(
    model: nn.Module, batch: Mapping[str, Tensor], prefix: str = "", head: LogitsHead = CHUNKED
) -> Tensor:
    """Summed log-probs ``[B]`` of the completion tokens of the ``prefix`` rows
    (``""``: the matched pairs, ``"kl_"``: the mismatched ones) of an unpaired batch
    (``head``: dense logits or the chunked head, which scores the completion tokens only)."""
    labels = batch[f"{prefix}labels"]
    mask = batch[f"{prefix}loss_mask"].bool() & (labels != IGNORE_INDEX)
    # right padding under a causal mask leaves the real tokens' logits unchanged
    targets = labels.masked_fill(~mask, IGNORE_INDEX)
    scores = head.scores(model, batch[f"{prefix}input_ids"], targets)
    return sequence_logprobs(scores.logp, mask, "sum")


def matched_and_kl_logprobs(
    model: nn.Module, batch: Mapping[str, Tensor], head: LogitsHead = CHUNKED
) -> tuple[Tensor, Tensor]:
    """:func:`completion_logprobs` of the matched and of the mismatched rows in one ``[2B, S]``
    forward (the collate pads both to one length)."""
    both = {
        k: torch.cat([batch[k], batch[f"kl_{k}"]]) for k in ("input_ids", "labels", "loss_mask")
    }
    seq = completion_logprobs(model, both, head=head)
    b = batch["input_ids"].shape[0]
    return seq[:b], seq[b:]


def _mean_over_ranks(value: Tensor) -> Tensor:
    """The mean of a scalar over the data-parallel ranks (itself on one process)."""
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        value = value.clone()
        dist.all_reduce(value)
        value = value / dist.get_world_size()
    return value


def kl_estimate(policy_kl: Tensor, reference_kl: Tensor) -> Tensor:
    """KTO's reference point ``z``: the batch mean of ``pi - ref`` on the mismatched pairs,
    detached, averaged over the ranks, then clamped at 0 (TRL's order)."""
    kl = (policy_kl - reference_kl).mean().detach()
    return _mean_over_ranks(kl).clamp(min=0)


def kto_loss(
    policy: Tensor,
    reference: Tensor,
    label: Tensor,
    kl: Tensor,
    *,
    beta: float = 0.1,
    desirable_weight: float = 1.0,
    undesirable_weight: float = 1.0,
    loss_type: str = "kto",
) -> tuple[Tensor, Tensor, Tensor]:
    """The mean weighted KTO loss over the batch and the implicit rewards ``beta * (pi -
    ref)`` of the desirable and of the undesirable rows (detached).

    ``policy``, ``reference``: summed completion log-probs ``[B]``; ``label``: ``[B]`` bool
    (True = desirable); ``kl``: the reference point (:func:`kl_estimate`; unused by
    ``apo_zero_unpaired``).
    """
    if loss_type not in LOSS_TYPES:
        raise ValueError(f"KTO loss_type must be one of {LOSS_TYPES}, got {loss_type!r}")
    label = label.bool()
    logratios = policy - reference
    chosen, rejected = logratios[label], logratios[~label]
    if loss_type == "kto":
        chosen_losses = 1 - F.sigmoid(beta * (chosen - kl))
        rejected_losses = 1 - F.sigmoid(beta * (kl - rejected))
    else:
        chosen_losses = 1 - F.sigmoid(beta * chosen)
        rejected_losses = F.sigmoid(beta * rejected)
    losses = torch.cat([desirable_weight * chosen_losses, undesirable_weight * rejected_losses])
    return losses.nanmean(), beta * chosen.detach(), beta * rejected.detach()


def kto_metrics(
    chosen_rewards: Tensor, rejected_rewards: Tensor, policy: Tensor, label: Tensor, kl: Tensor
) -> dict[str, Tensor]:
    """TRL's KTO metrics of one batch; the means of a side only when it has rows."""
    label = label.bool()
    logps = policy.detach()
    out: dict[str, Tensor] = {
        "kl": kl.detach().reshape(()),
        "count/chosen": label.sum().float(),
        "count/rejected": (~label).sum().float(),
    }
    if chosen_rewards.numel():
        out["rewards/chosen"] = chosen_rewards.nansum() / chosen_rewards.numel()
        out["logps/chosen"] = logps[label].nansum() / chosen_rewards.numel()
    if rejected_rewards.numel():
        out["rewards/rejected"] = rejected_rewards.nansum() / rejected_rewards.numel()
        out["logps/rejected"] = logps[~label].nansum() / rejected_rewards.numel()
    if chosen_rewards.numel() and rejected_rewards.numel():
        out["rewards/margins"] = out["rewards/chosen"] - out["rewards/rejected"]
    return out


def weight_advice(
    desirable: int, undesirable: int, desirable_weight: float, undesirable_weight: float
) -> str | None:
    """TRL's warning when the data's desirable:undesirable ratio calls for other weights:
    ``w_d * n_d / (w_u * n_u)`` should lie in ``[1, 4/3]`` (Eq. (8) of the KTO paper). None
    when the counts are equal or either weight is in its range."""
    n_d = max(desirable, 1)
    n_u = max(desirable + undesirable - n_d, 1)
    if n_d == n_u:
        return None
    d_lo = round(n_u * undesirable_weight / n_d, 2)
    d_hi = round(n_u * undesirable_weight / n_d * 1.33, 2)
    u_lo = round(n_d * desirable_weight / n_u / 1.33, 2)
    u_hi = round(n_d * desirable_weight / n_u, 2)
    if d_lo <= desirable_weight <= d_hi or u_lo <= undesirable_weight <= u_hi:
        return None
    return (
        f"KTO: the train data has {desirable} desirable and {undesirable} undesirable examples "
        f"but desirable_weight={desirable_weight}, undesirable_weight={undesirable_weight} are "
        f"outside the recommended range; set EITHER desirable_weight in [{d_lo}, {d_hi}] or "
        f"undesirable_weight in [{u_lo}, {u_hi}] (but not both)"
    )


# ---------------------------------------------------------------------------- the module


class KTOModule(LMModule):
    """KTO on unpaired batches (``UnpairedDataset``: ``input_ids``/``labels``/``loss_mask``,
    their ``kl_`` mismatched twins and ``label``).

    Args:
        beta: inverse temperature of the implicit reward (higher: stay closer to the
            reference); TRL's default 0.1.
        desirable_weight, undesirable_weight: weights of the desirable and undesirable
            examples' losses (> 0), to counter unequal amounts of each; a warning at fit start
            gives the range the training data calls for.
        loss_type: ``kto`` or ``apo_zero_unpaired`` (no KL estimate; then a batch of one is
            fine and the ``kl_`` rows are not forwarded).
        reference_dtype: e.g. ``bfloat16`` to halve the frozen reference copy's memory.

    The reference is a frozen copy of the initial policy (after ``init_from``). The other
    arguments are ``LMModule``'s.
    """

    def __init__(
        self,
        *,
        beta: float = 0.1,
        desirable_weight: float = 1.0,
        undesirable_weight: float = 1.0,
        loss_type: str = "kto",
        reference_dtype: str | torch.dtype | None = None,
        **kwargs: Any,
    ) -> None:
        if loss_type not in LOSS_TYPES:
            raise ValueError(f"KTO loss_type must be one of {LOSS_TYPES}, got {loss_type!r}")
        if beta <= 0:
            raise ValueError(f"KTO beta must be > 0, got {beta}")
        if desirable_weight <= 0:
            raise ValueError(f"KTO desirable_weight must be > 0, got {desirable_weight}")
        if undesirable_weight <= 0:
            raise ValueError(f"KTO undesirable_weight must be > 0, got {undesirable_weight}")
        if not (
            reference_dtype is None
            or isinstance(reference_dtype, torch.dtype)
            or isinstance(getattr(torch, str(reference_dtype), None), torch.dtype)
        ):
            raise ValueError(f"KTO reference_dtype must be a torch dtype, got {reference_dtype!r}")
        super().__init__(**kwargs)
        self.beta = float(beta)
        self.desirable_weight = float(desirable_weight)
        self.undesirable_weight = float(undesirable_weight)
        self.loss_type = loss_type
        self.reference = ReferencePolicy(self.model, reference_dtype)

    @property
    def uses_kl(self) -> bool:
        """Whether the loss has KTO's reference point (all but ``apo_zero_unpaired``)."""
        return self.loss_type != "apo_zero_unpaired"

    def on_fit_start(self) -> None:
        super().on_fit_start()
        dm = self.trainer.datamodule
        batch_size = getattr(dm, "batch_size", None)
        if self.uses_kl and batch_size is not None and batch_size < 2:
            raise ValueError(
                f"KTO loss_type={self.loss_type} estimates its KL term from the other rows of a "
                f"batch: data.batch_size must be > 1, got {batch_size}"
            )
        train = (getattr(dm, "datasets", None) or {}).get("train")
        counts = getattr(train, "label_counts", None)
        if callable(counts):
            desirable, undesirable = counts()
            advice = weight_advice(
                desirable, undesirable, self.desirable_weight, self.undesirable_weight
            )
            if advice and self.trainer.is_global_zero:
                log.warning(advice)

    def compute_loss(self, batch: dict[str, Any]) -> tuple[Tensor, dict[str, Tensor]]:
        label = batch["label"].bool()
        reference = self.reference.on(self.device)
        kl = torch.zeros((), device=label.device)
        with torch.no_grad():
            if self.uses_kl:
                # the policy's KL forward goes first: the last policy forward (whose MoE
                # router statistics LMModule reads) is the one with gradients
                policy_kl = completion_logprobs(self.model, batch, "kl_", self.head)
                ref, reference_kl = matched_and_kl_logprobs(reference, batch, self.head)
                kl = kl_estimate(policy_kl, reference_kl.to(policy_kl.dtype))
            else:
                ref = completion_logprobs(reference, batch, head=self.head)
        policy = completion_logprobs(self.model, batch, head=self.head)
        loss, chosen_rewards, rejected_rewards = kto_loss(
            policy,
            ref.to(policy.dtype),
            label,
            kl.to(policy.dtype),
            beta=self.beta,
            desirable_weight=self.desirable_weight,
            undesirable_weight=self.undesirable_weight,
            loss_type=self.loss_type,
        )
        return loss, kto_metrics(chosen_rewards, rejected_rewards, policy, label, kl)
