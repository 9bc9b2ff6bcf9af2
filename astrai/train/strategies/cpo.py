"""Reference-free preference optimisation: CPO and SimPO (TRL's ``CPOTrainer``).

CPO (Xu et al. 2024, "Contrastive Preference Optimization", arXiv:2401.08417) drops DPO's
frozen reference: the implicit reward of an answer is the policy's own ``beta * log pi(y|x)``,
so no second model is kept in memory or in checkpoints. A behaviour-cloning term keeps the
chosen answers likely::

    loss = mean_pairs L(z) + cpo_alpha * NLL(chosen),   z = pi_c - pi_r

where ``pi_*`` are log-probabilities of the response tokens (the preference batch's loss
mask) and ``NLL(chosen)`` is the mean cross entropy per chosen response token. ``L`` by
``loss_type`` (``eps`` = ``label_smoothing``)::

    sigmoid: -(1 - eps) log s(beta z) - eps log s(-beta z)   (CPO eq. 3, DPO's form)
    hinge:   max(0, 1 - beta z)                              (SLiC, Zhao et al. 2023)
    ipo:     (z - 1 / (2 beta))^2                            (IPO, Azar et al. 2023)
    simpo:   the sigmoid form of beta z - simpo_gamma        (SimPO, Meng et al. 2024)

``pi_*`` are summed over the response for sigmoid and hinge, and averaged over it for ipo and
simpo (as TRL does). SimPO proper (arXiv:2405.14734) is ``loss_type: simpo`` with
``cpo_alpha: 0`` (conf/strategy/simpo.yaml); its target margin ``gamma`` is TRL's
``simpo_gamma``, or ``gamma_beta_ratio * beta`` in the paper's parametrisation.
Logged rewards are ``beta * pi_*`` (``rewards/chosen``, ``rewards/rejected``, their accuracy
and margin).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch.nn.functional as F
from torch import Tensor

from astrai.train.module import LMModule
from astrai.train.preference import (
    chosen_nll,
    preference_logprobs,
    preference_metrics,
    smoothed_sigmoid_loss,
)

LOSS_TYPES = ("sigmoid", "hinge", "ipo", "simpo")
#: loss types on length-averaged log-probs (TRL's ``average_log_prob``)
AVERAGED = ("ipo", "simpo")
#: TRL's default target margin of SimPO
SIMPO_GAMMA = 0.5


def resolve_simpo_gamma(
    loss_type: str, beta: float, simpo_gamma: float | None, gamma_beta_ratio: float | None
) -> float:
    """The SimPO margin from either parametrisation (TRL's ``simpo_gamma`` or the paper's
    ``gamma_beta_ratio``); refuses both, or either with a loss that has no margin."""
    if simpo_gamma is not None and gamma_beta_ratio is not None:
        raise ValueError(
            "CPO: set either simpo_gamma or gamma_beta_ratio (simpo_gamma = gamma_beta_ratio * "
            f"beta), not both; got simpo_gamma={simpo_gamma}, gamma_beta_ratio={gamma_beta_ratio}"
        )
    for name, value in (("simpo_gamma", simpo_gamma), ("gamma_beta_ratio", gamma_beta_ratio)):
        if value is not None and loss_type != "simpo":
            raise ValueError(f"CPO {name} applies only to loss_type=simpo, got {loss_type!r}")
        if value is not None and value < 0:
            raise ValueError(f"CPO {name} must be >= 0, got {value}")
    if gamma_beta_ratio is not None:
        return float(gamma_beta_ratio) * float(beta)
    return SIMPO_GAMMA if simpo_gamma is None else float(simpo_gamma)


def check_cpo_options(
    loss_type: str, beta: float, label_smoothing: float, cpo_alpha: float
) -> None:
    """ValueError naming the first invalid option."""
    if loss_type not in LOSS_TYPES:
        raise ValueError(f"CPO loss_type must be one of {LOSS_TYPES}, got {loss_type!r}")
    if beta <= 0:
        raise ValueError(f"CPO beta must be > 0, got {beta}")
    if not 0.0 <= label_smoothing < 0.5:
        raise ValueError(f"CPO label_smoothing must be in [0, 0.5), got {label_smoothing}")
    if label_smoothing and loss_type in ("hinge", "ipo"):
        # TRL warns and ignores it; an option that does nothing is refused here
        raise ValueError(
            f"CPO label_smoothing applies only to loss_type sigmoid or simpo, got {loss_type!r}"
        )
    if cpo_alpha < 0:
        raise ValueError(f"CPO cpo_alpha must be >= 0, got {cpo_alpha}")


def cpo_loss(
    policy_chosen: Tensor,
    policy_rejected: Tensor,
    *,
    loss_type: str = "sigmoid",
    beta: float = 0.1,
    label_smoothing: float = 0.0,
    simpo_gamma: float = SIMPO_GAMMA,
) -> tuple[Tensor, Tensor, Tensor]:
    """Mean preference loss over the batch (without the NLL term) and the rewards
    ``beta * pi`` (detached), from sequence log-probs ``[B]`` (averaged for ipo/simpo)."""
    check_cpo_options(loss_type, beta, label_smoothing, 0.0)
    z = policy_chosen - policy_rejected
    if loss_type in ("sigmoid", "simpo"):
        margin = beta * z - (simpo_gamma if loss_type == "simpo" else 0.0)
        losses = smoothed_sigmoid_loss(margin, label_smoothing)
    elif loss_type == "hinge":
        losses = F.relu(1.0 - beta * z)
    else:  # ipo
        losses = (z - 1.0 / (2.0 * beta)) ** 2
    return losses.mean(), beta * policy_chosen.detach(), beta * policy_rejected.detach()


class CPOModule(LMModule):
    """CPO / SimPO on preference batches (``chosen_*`` / ``rejected_*``); no reference model.

    Args (TRL's ``CPOConfig`` names, defaults and meanings):
        loss_type: ``sigmoid`` (CPO), ``hinge``, ``ipo`` or ``simpo``.
        beta: inverse temperature of the reward ``beta * log pi`` (> 0); for ipo, the
            regulariser tau of the IPO paper.
        label_smoothing: conservative (cDPO-style) label-noise rate, in [0, 0.5); sigmoid and
            simpo only.
        cpo_alpha: weight of the chosen answers' NLL (the behaviour-cloning term); 0 = none
            (pure SimPO).
        simpo_gamma: SimPO's target reward margin (loss_type=simpo only; default 0.5).
        gamma_beta_ratio: the SimPO paper's ``gamma / beta``; sets
            ``simpo_gamma = gamma_beta_ratio * beta`` (give one of the two).

    The other arguments are ``LMModule``'s. ``self.reference`` stays None.
    """

    def __init__(
        self,
        *,
        loss_type: str = "sigmoid",
        beta: float = 0.1,
        label_smoothing: float = 0.0,
        cpo_alpha: float = 1.0,
        simpo_gamma: float | None = None,
        gamma_beta_ratio: float | None = None,
        **kwargs: Any,
    ) -> None:
        check_cpo_options(loss_type, beta, label_smoothing, cpo_alpha)
        gamma = resolve_simpo_gamma(loss_type, beta, simpo_gamma, gamma_beta_ratio)
        super().__init__(**kwargs)
        self.loss_type = loss_type
        self.beta = float(beta)
        self.label_smoothing = float(label_smoothing)  # CPO's, as DPO's (no token loss here)
        self.cpo_alpha = float(cpo_alpha)
        self.simpo_gamma = gamma
        self.reduction = "mean" if loss_type in AVERAGED else "sum"

    def compute_loss(self, batch: Mapping[str, Any]) -> tuple[Tensor, dict[str, Tensor]]:
        pc, pr = preference_logprobs(self.model, batch, self.reduction, head=self.head)
        loss, cr, rj = cpo_loss(
            pc,
            pr,
            loss_type=self.loss_type,
            beta=self.beta,
            label_smoothing=self.label_smoothing,
            simpo_gamma=self.simpo_gamma,
        )
        nll = chosen_nll(pc, batch, self.reduction)
        if self.cpo_alpha:
            loss = loss + self.cpo_alpha * nll
        metrics = preference_metrics(cr, rj, pc, pr)
        metrics["nll_loss"] = nll.detach()
        return loss, metrics
