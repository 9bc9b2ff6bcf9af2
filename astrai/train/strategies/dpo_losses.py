"""The DPO loss family: pure functions of sequence log-probs (TRL 1.16 ``DPOConfig`` names).

Every loss reads the policy's and the reference's response log-probs of each pair, ``pi_c,
pi_r, ref_c, ref_r`` (``[B]``), through the log-ratios ``lr_c = pi_c - ref_c`` and ``lr_r =
pi_r - ref_r``. The f-DPO scores ``s = f'(exp(lr))`` (Wang et al. 2023, "Beyond reverse KL")
replace the log-ratios in the losses built on their difference ``d = s_c - s_r``:

- ``reverse_kl`` (plain DPO): ``s = lr``; ``forward_kl``: ``s = 1 - exp(-lr)``;
  ``js_divergence``: ``s = log 2 + log sigmoid(lr)``; ``alpha_divergence`` (coefficient
  ``a = f_alpha_divergence_coef``): ``s = (exp((a - 1) lr) - 1) / (a - 1)``.

With ``z = beta * d`` and ``eps = label_smoothing``, per pair:

- ``sigmoid``  DPO (Rafailov et al. 2023): ``-log sig(z)``; with ``eps > 0`` cDPO
  ``-(1-eps) log sig(z) - eps log sig(-z)`` (ours: TRL 1.16's sigmoid ignores ``eps``)
- ``hinge``    SLiC (Zhao et al. 2023): ``relu(1 - z)``
- ``ipo``      IPO (Azar et al. 2023), per-token scores: ``(s_c/n_c - s_r/n_r - 1/(2 beta))^2``
- ``exo_pair`` EXO (Ji et al. 2024): ``KL(softmax(z, -z) || (1-eps, eps))``
- ``nca_pair`` NCA (Chen et al. 2024): ``-log sig(b_c) - log sig(-b_c)/2 - log sig(-b_r)/2``
  with the rewards ``b = beta * lr``
- ``robust``   rDPO (Chowdhury et al. 2024): ``(-(1-eps) log sig(z) + eps log sig(-z)) / (1-2eps)``
- ``bco_pair`` BCO (Jung et al. 2024), without its running reward shift as in TRL 1.16:
  ``-log sig(b_c) - log sig(-b_r)``
- ``sppo_hard`` SPPO (Wu et al. 2024), hard labels: ``(lr_c - 1/(2 beta))^2 + (lr_r + 1/(2 beta))^2``
- ``aot``      AOT (Melnyk et al. 2024): cDPO on ``sort(pi_c - pi_r) - sort(ref_c - ref_r)``
  (sorted over the batch); ``aot_unpaired``: on ``sort(lr_c) - sort(lr_r)``
- ``apo_zero`` / ``apo_down`` APO (D'Oosterlinck et al. 2024):
  ``1 - sig(b_c) + sig(b_r)`` / ``sig(b_c) + 1 - sig(b_c - b_r)``
- ``discopop`` DiscoPOP (Lu et al. 2024): ``m = sig(z / tau)``,
  ``(1 - m) (-log sig(z)) + m exp(-z)``
- ``sft``      the chosen responses' NLL, mean over their tokens (the batch's, not per pair)
- ``sigmoid_norm`` ``-log sig(beta (s_c/n_c - s_r/n_r))`` (``n``: response token counts)

Several loss types combine as MPO does (Wang et al. 2024): ``loss = sum_i w_i mean(loss_i)``
with ``loss_weights`` (default all 1). The implicit rewards are ``beta * lr`` whatever the loss.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

from astrai.train.preference import smoothed_sigmoid_loss

LOSS_TYPES = (
    "sigmoid",
    "hinge",
    "ipo",
    "exo_pair",
    "nca_pair",
    "robust",
    "bco_pair",
    "sppo_hard",
    "aot",
    "aot_unpaired",
    "apo_zero",
    "apo_down",
    "discopop",
    "sft",
    "sigmoid_norm",
)
F_DIVERGENCES = ("reverse_kl", "forward_kl", "js_divergence", "alpha_divergence")
#: The losses built on the chosen-rejected score difference: f-DPO's normaliser ``beta log
#: Z(x)`` cancels only there, so only they take another f-divergence (as TRL).
F_DIVERGENCE_LOSS_TYPES = frozenset(
    {"sigmoid", "sigmoid_norm", "hinge", "ipo", "exo_pair", "robust", "discopop", "sft"}
)
#: Losses that divide the scores by the response token counts themselves.
LENGTH_NORMALISED = frozenset({"ipo", "sigmoid_norm"})


@dataclass(frozen=True)
class PreferenceLogps:
    """What the losses read, per pair ``[B]``: policy and reference response log-probs, the
    response token counts (``ipo``, ``sigmoid_norm``) and the chosen tokens' mean NLL
    (``sft``; a scalar)."""

    policy_chosen: Tensor
    policy_rejected: Tensor
    ref_chosen: Tensor
    ref_rejected: Tensor
    chosen_tokens: Tensor | None = None
    rejected_tokens: Tensor | None = None
    chosen_nll: Tensor | None = None


@dataclass(frozen=True)
class LossOptions:
    """The options of the family (TRL's names and defaults)."""

    beta: float = 0.1
    label_smoothing: float = 0.0
    f_divergence_type: str = "reverse_kl"
    f_alpha_divergence_coef: float = 0.5
    discopop_tau: float = 0.05


class LossOutput(NamedTuple):
    loss: Tensor
    components: dict[str, Tensor]
    chosen_rewards: Tensor
    rejected_rewards: Tensor


# ---------------------------------------------------------------------------- validation


def check_loss_options(
    loss_type: str | Sequence[str],
    loss_weights: Sequence[float] | None,
    opts: LossOptions,
) -> tuple[tuple[str, ...], tuple[float, ...]]:
    """Validate the options (each error names its option) and return the loss types and their
    weights as tuples; a sequence may be Hydra's ListConfig."""
    types = (loss_type,) if isinstance(loss_type, str) else tuple(str(t) for t in loss_type)
    if not types:
        raise ValueError("DPO loss_type: give at least one loss type")
    unknown = [t for t in types if t not in LOSS_TYPES]
    if unknown:
        raise ValueError(f"DPO loss_type: unknown {unknown}; expected some of {list(LOSS_TYPES)}")
    if len(set(types)) != len(types):
        raise ValueError(f"DPO loss_type: {list(types)} names a loss type twice")
    if loss_weights is None:
        weights = (1.0,) * len(types)
    else:
        weights = tuple(float(w) for w in loss_weights)
        if len(weights) != len(types):
            raise ValueError(
                f"DPO loss_weights: {len(weights)} weights for {len(types)} loss types "
                f"{list(types)}; give one weight per loss type"
            )
    if opts.beta <= 0:
        raise ValueError(f"DPO beta must be > 0, got {opts.beta}")
    if not 0.0 <= opts.label_smoothing < 0.5:
        raise ValueError(f"DPO label_smoothing must be in [0, 0.5), got {opts.label_smoothing}")
    if "exo_pair" in types and opts.label_smoothing == 0.0:
        raise ValueError(
            "DPO loss_type exo_pair needs label_smoothing > 0 (its epsilon; the EXO paper uses 1e-3)"
        )
    if opts.f_divergence_type not in F_DIVERGENCES:
        raise ValueError(
            f"DPO f_divergence_type must be one of {F_DIVERGENCES}, got {opts.f_divergence_type!r}"
        )
    if opts.f_divergence_type != "reverse_kl" and not set(types) <= F_DIVERGENCE_LOSS_TYPES:
        raise ValueError(
            f"DPO f_divergence_type={opts.f_divergence_type!r} works only with the loss types "
            f"{sorted(F_DIVERGENCE_LOSS_TYPES)}; loss_type is {list(types)}"
        )
    if opts.discopop_tau <= 0:
        raise ValueError(f"DPO discopop_tau must be > 0, got {opts.discopop_tau}")
    return types, weights


# ---------------------------------------------------------------------------- scores


def f_divergence_scores(
    logratios: Tensor, f_divergence_type: str = "reverse_kl", alpha: float = 0.5
) -> Tensor:
    """f-DPO's ``f'(pi / ref)`` of the log-ratios (the identity for ``reverse_kl``)."""
    if f_divergence_type == "reverse_kl":
        return logratios
    if f_divergence_type == "forward_kl":
        return 1 - torch.exp(-logratios)
    if f_divergence_type == "js_divergence":
        return math.log(2) + F.logsigmoid(logratios)
    if f_divergence_type == "alpha_divergence":
        if abs(alpha - 1.0) < 1e-6:  # the limit a -> 1 is reverse KL
            return logratios
        t = (alpha - 1.0) * logratios
        # exp() stays finite in the input's dtype (TRL's bounds), computed in >= fp32
        bound = 11.0 if t.dtype == torch.float16 else 80.0
        wide = t if t.dtype == torch.float64 else t.float()
        return (torch.exp(wide.clamp(max=bound)) - 1.0).to(t.dtype) / (alpha - 1.0)
    raise ValueError(f"DPO f_divergence_type: unknown {f_divergence_type!r}")


class _Ctx(NamedTuple):
    x: PreferenceLogps
    o: LossOptions
    lr_c: Tensor  # log-ratios
    lr_r: Tensor
    s_c: Tensor  # f-divergence scores
    s_r: Tensor


def _per_token_delta(c: _Ctx) -> Tensor:
    if c.x.chosen_tokens is None or c.x.rejected_tokens is None:
        raise ValueError("DPO loss_type ipo / sigmoid_norm need the response token counts")
    n_c = c.x.chosen_tokens.to(c.s_c.dtype).clamp(min=1.0)
    n_r = c.x.rejected_tokens.to(c.s_r.dtype).clamp(min=1.0)
    return c.s_c / n_c - c.s_r / n_r


def _sigmoid(c: _Ctx) -> Tensor:
    return smoothed_sigmoid_loss(c.o.beta * (c.s_c - c.s_r), c.o.label_smoothing)


def _hinge(c: _Ctx) -> Tensor:
    return torch.relu(1 - c.o.beta * (c.s_c - c.s_r))


def _ipo(c: _Ctx) -> Tensor:
    # beta is IPO's tau; the per-token scores keep it comparable across response lengths
    return (_per_token_delta(c) - 1 / (2 * c.o.beta)) ** 2


def _exo_pair(c: _Ctx) -> Tensor:
    z, eps = c.o.beta * (c.s_c - c.s_r), c.o.label_smoothing
    win = torch.sigmoid(z) * (F.logsigmoid(z) - math.log1p(-eps))
    lose = torch.sigmoid(-z) * (F.logsigmoid(-z) - math.log(eps))
    return win + lose


def _nca_pair(c: _Ctx) -> Tensor:
    b_c, b_r = c.o.beta * c.lr_c, c.o.beta * c.lr_r
    return -F.logsigmoid(b_c) - 0.5 * F.logsigmoid(-b_c) - 0.5 * F.logsigmoid(-b_r)


def _robust(c: _Ctx) -> Tensor:
    z, eps = c.o.beta * (c.s_c - c.s_r), c.o.label_smoothing
    return (-(1 - eps) * F.logsigmoid(z) + eps * F.logsigmoid(-z)) / (1 - 2 * eps)


def _bco_pair(c: _Ctx) -> Tensor:
    return -F.logsigmoid(c.o.beta * c.lr_c) - F.logsigmoid(-c.o.beta * c.lr_r)


def _sppo_hard(c: _Ctx) -> Tensor:
    half = 0.5 / c.o.beta
    return (c.lr_c - half) ** 2 + (c.lr_r + half) ** 2


def _aot(c: _Ctx) -> Tensor:
    policy = torch.sort(c.x.policy_chosen - c.x.policy_rejected, dim=0).values
    ref = torch.sort(c.x.ref_chosen - c.x.ref_rejected, dim=0).values
    return smoothed_sigmoid_loss(c.o.beta * (policy - ref), c.o.label_smoothing)


def _aot_unpaired(c: _Ctx) -> Tensor:
    delta = torch.sort(c.lr_c, dim=0).values - torch.sort(c.lr_r, dim=0).values
    return smoothed_sigmoid_loss(c.o.beta * delta, c.o.label_smoothing)


def _apo_zero(c: _Ctx) -> Tensor:
    # chosen better than the model's own answers: raise chosen, lower rejected
    return 1 - torch.sigmoid(c.o.beta * c.lr_c) + torch.sigmoid(c.o.beta * c.lr_r)


def _apo_down(c: _Ctx) -> Tensor:
    # chosen worse than the model's own answers: lower both, rejected more
    b_c, b_r = c.o.beta * c.lr_c, c.o.beta * c.lr_r
    return torch.sigmoid(b_c) + 1 - torch.sigmoid(b_c - b_r)


def _discopop(c: _Ctx) -> Tensor:
    z = c.o.beta * (c.s_c - c.s_r)
    mix = torch.sigmoid(z / c.o.discopop_tau)
    return -F.logsigmoid(z) * (1 - mix) + torch.exp(-z) * mix


def _sft(c: _Ctx) -> Tensor:
    if c.x.chosen_nll is None:
        raise ValueError("DPO loss_type sft needs the chosen responses' NLL")
    return c.x.chosen_nll.expand_as(c.lr_c)


def _sigmoid_norm(c: _Ctx) -> Tensor:
    return -F.logsigmoid(c.o.beta * _per_token_delta(c))


_LOSSES: dict[str, Callable[[_Ctx], Tensor]] = {
    "sigmoid": _sigmoid,
    "hinge": _hinge,
    "ipo": _ipo,
    "exo_pair": _exo_pair,
    "nca_pair": _nca_pair,
    "robust": _robust,
    "bco_pair": _bco_pair,
    "sppo_hard": _sppo_hard,
    "aot": _aot,
    "aot_unpaired": _aot_unpaired,
    "apo_zero": _apo_zero,
    "apo_down": _apo_down,
    "discopop": _discopop,
    "sft": _sft,
    "sigmoid_norm": _sigmoid_norm,
}
assert tuple(_LOSSES) == LOSS_TYPES


def per_pair_loss(x: PreferenceLogps, loss_type: str, opts: LossOptions) -> Tensor:
    """One loss type's value for every pair, ``[B]`` (``sft``: the batch's NLL repeated)."""
    lr_c = x.policy_chosen - x.ref_chosen
    lr_r = x.policy_rejected - x.ref_rejected
    fd, a = opts.f_divergence_type, opts.f_alpha_divergence_coef
    ctx = _Ctx(
        x, opts, lr_c, lr_r, f_divergence_scores(lr_c, fd, a), f_divergence_scores(lr_r, fd, a)
    )
    try:
        fn = _LOSSES[loss_type]
    except KeyError:
        raise ValueError(
            f"DPO loss_type: unknown {loss_type!r}; expected one of {LOSS_TYPES}"
        ) from None
    return fn(ctx)


def preference_loss(
    x: PreferenceLogps,
    loss_types: Sequence[str] = ("sigmoid",),
    loss_weights: Sequence[float] | None = None,
    opts: LossOptions | None = None,
) -> LossOutput:
    """``sum_i w_i * mean_pairs(loss_i)``, each component's batch mean (undetached; for
    logging) and the implicit rewards ``beta * (pi - ref)`` (detached)."""
    opts = opts or LossOptions()
    weights = [1.0] * len(loss_types) if loss_weights is None else list(loss_weights)
    if len(weights) != len(loss_types):
        raise ValueError(f"DPO loss_weights: {len(weights)} weights for {len(loss_types)} losses")
    components = {t: per_pair_loss(x, t, opts).mean() for t in loss_types}
    loss = sum(w * components[t] for t, w in zip(loss_types, weights))
    chosen_rewards = opts.beta * (x.policy_chosen - x.ref_chosen).detach()
    rejected_rewards = opts.beta * (x.policy_rejected - x.ref_rejected).detach()
    return LossOutput(loss, components, chosen_rewards, rejected_rewards)
