"""Odds-ratio preference optimisation (ORPO, Hong et al. 2024, arXiv:2403.07691), TRL's
``ORPOTrainer``.

ORPO folds preference learning into supervised fine-tuning, with no reference model: the
language-model loss on the chosen answer plus a penalty on the log odds ratio of chosen
over rejected::

    loss = NLL(chosen) - beta * mean_pairs log s(log_odds)
    log_odds = log(p_c / (1 - p_c)) - log(p_r / (1 - p_r))
             = (pi_c - pi_r) - (log(1 - exp(pi_c)) - log(1 - exp(pi_r)))

where ``pi_*`` are the *length-averaged* response log-probabilities (``p = exp(pi)`` the
geometric-mean token probability) and ``beta`` is the paper's lambda (TRL's name and default
0.1). As in TRL (and the paper's code), ``NLL(chosen)`` is the mean cross entropy over every
predicted token of the chosen sequence, prompt included; the odds use the response only.
Logged: ``rewards/chosen`` / ``rewards/rejected`` (``beta * pi_*``) with their accuracy and
margin, ``logps/*``, ``nll_loss``, ``log_odds_ratio`` (mean ``log s(log_odds)``) and
``log_odds_chosen`` (mean ``log_odds``), TRL's names.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from astrai.data.datasets import IGNORE_INDEX
from astrai.likelihood import CHUNKED, LogitsHead
from astrai.train.module import LMModule
from astrai.train.preference import preference_metrics, response_nll, sequence_logprobs

_LOG_HALF = -math.log(2.0)


def log1mexp(x: Tensor) -> Tensor:
    """``log(1 - exp(x))`` for ``x < 0`` without cancellation (Maechler 2012): ``log1p``
    below ``-log 2``, ``expm1`` above. Each branch sees a clamped input, so the branch not
    taken never puts an inf or NaN into the gradient."""
    low = torch.log1p(-torch.exp(x.clamp(max=_LOG_HALF)))
    high = torch.log(-torch.expm1(x.clamp(min=_LOG_HALF)))
    return torch.where(x < _LOG_HALF, low, high)


def orpo_log_odds(policy_chosen: Tensor, policy_rejected: Tensor) -> Tensor:
    """Log odds ratio of chosen over rejected ``[B]`` from length-averaged log-probs."""
    return (policy_chosen - policy_rejected) - (log1mexp(policy_chosen) - log1mexp(policy_rejected))


def full_sequence_labels(batch: Mapping[str, Tensor], side: str) -> Tensor:
    """Next-token labels over the whole sequence (prompt included): ``labels[t]`` is the
    token after ``input_ids[t]`` wherever that token is real; ``IGNORE_INDEX`` on padding.

    The batch's own labels keep only the response; the sequence's last token (which is not
    in ``input_ids``) is taken from them."""
    ids, labels = batch[f"{side}_input_ids"], batch[f"{side}_labels"]
    real = batch[f"{side}_attention_mask"].bool()
    full = labels.clone()
    next_real = real[:, 1:]
    full[:, :-1] = torch.where(next_real, ids[:, 1:], labels[:, :-1])
    return full.masked_fill(~real, IGNORE_INDEX)


def orpo_logprobs(
    model: nn.Module, batch: Mapping[str, Tensor], head: LogitsHead = CHUNKED
) -> tuple[Tensor, Tensor, Tensor]:
    """``(pi_c [B], pi_r [B], nll)`` in one ``[2B, S]`` forward: the length-averaged response
    log-probs and the chosen sequences' mean cross entropy over all their tokens (``head``:
    dense logits or the chunked head)."""
    b = batch["chosen_input_ids"].shape[0]
    ids = torch.cat([batch["chosen_input_ids"], batch["rejected_input_ids"]])
    labels = torch.cat([batch["chosen_labels"], batch["rejected_labels"]])
    response = torch.cat([batch["chosen_loss_mask"], batch["rejected_loss_mask"]]).bool()
    full = torch.cat([full_sequence_labels(batch, s) for s in ("chosen", "rejected")])
    # right padding under a causal mask leaves the real tokens' logits unchanged
    tok = head.scores(model, ids, full).logp
    seq = sequence_logprobs(tok, response & (labels != IGNORE_INDEX), "mean")
    return seq[:b], seq[b:], response_nll(tok[:b], full[:b] != IGNORE_INDEX)


def orpo_loss(
    policy_chosen: Tensor, policy_rejected: Tensor, nll: Tensor, beta: float = 0.1
) -> tuple[Tensor, Tensor]:
    """ORPO's loss and its log odds ``[B]`` from length-averaged log-probs and the NLL."""
    log_odds = orpo_log_odds(policy_chosen, policy_rejected)
    return nll - beta * F.logsigmoid(log_odds).mean(), log_odds


class ORPOModule(LMModule):
    """ORPO on preference batches (``chosen_*`` / ``rejected_*``); no reference model.

    Args:
        beta: weight of the odds-ratio term (the paper's lambda, TRL's ``beta``; >= 0,
            0 = plain SFT on the chosen sequences).

    The other arguments are ``LMModule``'s. ``self.reference`` stays None.
    """

    def __init__(self, *, beta: float = 0.1, **kwargs: Any) -> None:
        if beta < 0:
            raise ValueError(f"ORPO beta must be >= 0, got {beta}")
        super().__init__(**kwargs)
        self.beta = float(beta)

    def compute_loss(self, batch: Mapping[str, Any]) -> tuple[Tensor, dict[str, Tensor]]:
        pc, pr, nll = orpo_logprobs(self.model, batch, self.head)
        loss, log_odds = orpo_loss(pc, pr, nll, self.beta)
        metrics = preference_metrics(self.beta * pc.detach(), self.beta * pr.detach(), pc, pr)
        metrics["nll_loss"] = nll.detach()
        metrics["log_odds_ratio"] = F.logsigmoid(log_odds).detach().mean()
        metrics["log_odds_chosen"] = log_odds.detach().mean()
        return loss, metrics
