"""Direct preference optimisation (DPO, Rafailov et al. 2023) and its loss family.

The loss pushes the policy's log-ratio against a frozen reference up for the chosen answer
and down for the rejected one::

    loss = -log sigmoid(beta * ((pi_c - ref_c) - (pi_r - ref_r)))

where ``pi_*`` / ``ref_*`` are log-probabilities of the *response* tokens (the loss mask of
the preference batch), summed (``reduction: sum``, the paper's and TRL's) or averaged over
the response (``reduction: mean``: no pull towards longer or shorter answers). The reference is either a frozen copy of the initial policy
(``reference: copy``) or its log-probabilities computed once over the train and val sets
before training (``reference: precomputed``; no second model in memory, the values travel
in the Lightning checkpoint so a resumed run uses the same ones).

``loss_type`` picks TRL 1.16's other losses on the same log-probs (IPO, EXO, NCA, robust,
BCO, SPPO, AOT, APO, DiscoPOP, SFT, ...), alone or weighted together (MPO), and
``f_divergence_type`` f-DPO's regulariser: see :mod:`astrai.train.strategies.dpo_losses`.

LD-DPO (Liu et al. 2024, ``ld_alpha``): the tokens of the longer response past the shorter
one's length count ``ld_alpha`` times, for the policy and the reference alike::

    pi = sum_{t <= min(n_c, n_r)} log p_t + ld_alpha * sum_{t > min(n_c, n_r)} log p_t

which takes the length bias out of the summed log-probs (``ld_alpha = 1``: plain DPO).

``padding_free``: the ``2B`` chosen and rejected sequences are packed into one row without
padding, position ids restarting at 0 for each, forwarded once (the model keeps the
sequences apart by their position ids) and unpacked: the same log-probs with no pad token
computed. Attention then runs over one ``T x T`` block-diagonal mask (``T``: the batch's
real tokens), so it pays off when padding is a large part of the batch.
"""

from __future__ import annotations

import hashlib
import logging
import math
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.data import DataLoader, Subset

from astrai.likelihood import CHUNKED, LogitsHead
from astrai.train.module import LMModule, ReferencePolicy
from astrai.train.preference import (
    REDUCTIONS,
    preference_logprobs,
    preference_metrics,
    preference_token_logprobs,
    reduce_preference,
    response_nll,
)
from astrai.train.strategies.dpo_losses import (
    LENGTH_NORMALISED,
    LossOptions,
    PreferenceLogps,
    check_loss_options,
    preference_loss,
)

log = logging.getLogger(__name__)

REFERENCE_MODES = ("copy", "precomputed")


# ---------------------------------------------------------------------------- pure functions


def dpo_loss(
    policy_chosen: Tensor,
    policy_rejected: Tensor,
    ref_chosen: Tensor,
    ref_rejected: Tensor,
    beta: float = 0.1,
    label_smoothing: float = 0.0,
) -> tuple[Tensor, Tensor, Tensor]:
    """Mean DPO loss over the batch, and the implicit rewards ``beta * (pi - ref)``.

    Inputs are sequence log-probs ``[B]``. ``label_smoothing`` > 0 gives the conservative
    DPO variant (cDPO: the preference label is wrong with that probability).
    """
    if beta <= 0:
        raise ValueError(f"dpo_loss: beta must be > 0, got {beta}")
    if not 0.0 <= label_smoothing < 0.5:
        raise ValueError(f"dpo_loss: label_smoothing must be in [0, 0.5), got {label_smoothing}")
    x = PreferenceLogps(policy_chosen, policy_rejected, ref_chosen, ref_rejected)
    out = preference_loss(x, ("sigmoid",), None, LossOptions(beta, label_smoothing))
    return out.loss, out.chosen_rewards, out.rejected_rewards


def pair_key(chosen_ids: Tensor, rejected_ids: Tensor) -> str:
    """Content key of one preference pair (unpadded ids): looks up precomputed reference
    log-probs independently of sampler order, rank count or batch composition."""
    h = hashlib.sha1(chosen_ids.to(torch.int64).cpu().numpy().tobytes())
    h.update(b"|")
    h.update(rejected_ids.to(torch.int64).cpu().numpy().tobytes())
    return h.hexdigest()


def batch_pair_keys(batch: Mapping[str, Tensor]) -> list[str]:
    """:func:`pair_key` for every row of a collated preference batch."""
    keys = []
    for i in range(batch["chosen_input_ids"].shape[0]):
        nc = int(batch["chosen_attention_mask"][i].sum())
        nr = int(batch["rejected_attention_mask"][i].sum())
        keys.append(
            pair_key(batch["chosen_input_ids"][i, :nc], batch["rejected_input_ids"][i, :nr])
        )
    return keys


def precompute_reference(
    model: nn.Module,
    batches: Iterable[Mapping[str, Tensor]],
    device: torch.device,
    reduction: str = "sum",
    *,
    ld_alpha: float | None = None,
    padding_free: bool = False,
    head: LogitsHead = CHUNKED,
) -> dict[str, tuple[float, float]]:
    """``{pair_key: (ref_chosen, ref_rejected)}`` over ``batches`` with ``model`` as reference
    (LD-weighted with ``ld_alpha``: the weights depend only on the pair's own lengths)."""
    out: dict[str, tuple[float, float]] = {}
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            for batch in batches:
                batch = {k: v.to(device) if isinstance(v, Tensor) else v for k, v in batch.items()}
                c, r = preference_logprobs(
                    model, batch, reduction, ld_alpha=ld_alpha, padding_free=padding_free, head=head
                )
                for key, vc, vr in zip(batch_pair_keys(batch), c.tolist(), r.tolist()):
                    out[key] = (vc, vr)
    finally:
        model.train(was_training)
    return out


def repeat_last(batches: Iterable[Any], count: int) -> Iterator[Any]:
    """``batches``, then its last one again until ``count`` were given: every rank runs as
    many forwards (under FSDP2 each is a collective); a repeated batch gives the same
    values again, so the table is unchanged."""
    last, given = None, 0
    for last in batches:
        given += 1
        yield last
    while last is not None and given < count:
        given += 1
        yield last


# ---------------------------------------------------------------------------- the module


class DPOModule(LMModule):
    """DPO and its loss family on preference batches (``chosen_*`` / ``rejected_*``, see
    ``PreferenceDataset``). Options take TRL 1.16 ``DPOConfig``'s names, defaults and meanings.

    Args:
        beta: inverse temperature of the implicit reward (0.1 is the usual default; IPO's tau).
        label_smoothing: the label-noise rate of cDPO (``sigmoid``: TRL 1.16 ignores it there),
            ``robust``, ``aot``/``aot_unpaired`` and EXO's epsilon (``exo_pair`` needs > 0);
            in [0, 0.5).
        loss_type: one of :data:`~astrai.train.strategies.dpo_losses.LOSS_TYPES` or a list of
            them, combined as ``sum_i loss_weights[i] * loss_i`` (MPO: ``[sigmoid, bco_pair,
            sft]`` with ``[0.8, 0.2, 1.0]``).
        loss_weights: one weight per loss type (default all 1).
        f_divergence_type: f-DPO's divergence, ``reverse_kl`` (plain DPO), ``forward_kl``,
            ``js_divergence`` or ``alpha_divergence`` (with ``f_alpha_divergence_coef``); the
            non-default ones only with the losses on the chosen-rejected score difference.
        discopop_tau: DiscoPOP's temperature.
        ld_alpha: LD-DPO: the longer response's tokens past the shorter one's length count
            ``ld_alpha`` times (policy and reference); None = off. Needs ``reduction: sum``.
        padding_free: pack the batch's ``2B`` sequences into one unpadded row per forward.
        reference: ``copy`` keeps a frozen copy of the initial policy (``self.reference``, a
            ``ReferencePolicy``: not in the optimizer, not in checkpoints, moved to the device
            on first use); ``precomputed`` computes the reference log-probs of every train/val
            pair once in ``on_fit_start`` and stores them in the checkpoint instead (LD-weighted
            when ``ld_alpha`` is set).
        reference_dtype: e.g. ``bfloat16`` to halve the frozen copy's memory.
        precompute_batch_size: batch size of the precomputation pass.
        reduction: ``sum`` (default; the paper's, TRL's) or ``mean`` of the response tokens'
            log-probs, for the policy and the reference alike (``ipo`` and ``sigmoid_norm``
            average per token themselves and need ``sum``).
        rpo_alpha: weight of the chosen responses' negative log-likelihood (mean over their
            tokens) added to the loss: RPO / iterative RPO (Pang et al. 2024). Plain DPO lowers
            the chosen likelihood too when both answers of a pair share most tokens (worked
            solutions that differ in one digit); the NLL term keeps the correct answers
            likely. 0 (default) = off; the same term as ``loss_type: [sigmoid, sft]`` with
            weights ``[1, rpo_alpha]``.

    The other arguments (``model``, ``optimizer``, ``tokenizer``, ``init_from``, ...) are
    ``LMModule``'s; ``init_from`` (typically the SFT export) is applied before the reference
    copy is taken.
    """

    def __init__(
        self,
        *,
        beta: float = 0.1,
        label_smoothing: float = 0.0,
        loss_type: str | Sequence[str] = "sigmoid",
        loss_weights: Sequence[float] | None = None,
        f_divergence_type: str = "reverse_kl",
        f_alpha_divergence_coef: float = 0.5,
        discopop_tau: float = 0.05,
        ld_alpha: float | None = None,
        padding_free: bool = False,
        reference: str = "copy",
        reference_dtype: str | None = None,
        precompute_batch_size: int = 16,
        reduction: str = "sum",
        rpo_alpha: float = 0.0,
        **kwargs: Any,
    ) -> None:
        # every option is checked before the model is built
        if rpo_alpha < 0:
            raise ValueError(f"DPO rpo_alpha must be >= 0, got {rpo_alpha}")
        if reduction not in REDUCTIONS:
            raise ValueError(f"DPO reduction must be one of {REDUCTIONS}, got {reduction!r}")
        if reference not in REFERENCE_MODES:
            raise ValueError(f"DPO reference must be one of {REFERENCE_MODES}, got {reference!r}")
        options = LossOptions(
            beta=float(beta),
            label_smoothing=float(label_smoothing),
            f_divergence_type=str(f_divergence_type),
            f_alpha_divergence_coef=float(f_alpha_divergence_coef),
            discopop_tau=float(discopop_tau),
        )
        loss_types, weights = check_loss_options(loss_type, loss_weights, options)
        if reduction != "sum" and LENGTH_NORMALISED & set(loss_types):
            raise ValueError(
                f"DPO loss_type {sorted(LENGTH_NORMALISED & set(loss_types))} average the "
                f"log-ratios over the response tokens themselves: use reduction=sum, not "
                f"{reduction!r}"
            )
        if ld_alpha is not None:
            if not 0.0 <= ld_alpha <= 1.0:
                raise ValueError(f"DPO ld_alpha must be in [0, 1] (or null), got {ld_alpha}")
            if reduction != "sum":
                raise ValueError("DPO ld_alpha weights summed log-probs: it needs reduction=sum")
        if not isinstance(padding_free, bool):
            raise ValueError(f"DPO padding_free must be true or false, got {padding_free!r}")
        super().__init__(**kwargs)
        self.loss_options = options
        self.beta = options.beta
        self.label_smoothing = options.label_smoothing
        self.loss_types = loss_types
        self.loss_weights = weights
        self.ld_alpha = None if ld_alpha is None else float(ld_alpha)
        self.padding_free = padding_free
        self.reference_mode = reference
        self.precompute_batch_size = int(precompute_batch_size)
        self.reduction = reduction
        self.rpo_alpha = float(rpo_alpha)
        if reference == "copy":
            self.reference = ReferencePolicy(self.model, reference_dtype)
        self._ref_table: dict[str, tuple[float, float]] | None = None

    # ------------------------------------------------------------------ reference
    def reference_logprobs(self, batch: Mapping[str, Tensor]) -> tuple[Tensor, Tensor]:
        if self.reference_mode == "copy":
            with torch.no_grad():
                return preference_logprobs(
                    self.reference.on(self.device),
                    batch,
                    self.reduction,
                    ld_alpha=self.ld_alpha,
                    padding_free=self.padding_free,
                    head=self.head,
                )
        if self._ref_table is None:
            raise RuntimeError("DPO reference log-probs were not precomputed (on_fit_start)")
        vals = []
        for key in batch_pair_keys(batch):
            try:
                vals.append(self._ref_table[key])
            except KeyError:
                raise RuntimeError(
                    "DPO reference: a pair was not in the precomputed table (the data changed "
                    "after precomputation?); use strategy.reference=copy or restart the run"
                ) from None
        t = torch.tensor(vals, dtype=torch.float32, device=self.device)
        return t[:, 0], t[:, 1]

    def on_fit_start(self) -> None:
        super().on_fit_start()
        if self.reference_mode == "precomputed" and self._ref_table is None:
            self._ref_table = self._precompute()

    def _precompute(self) -> dict[str, tuple[float, float]]:
        dm = self.trainer.datamodule
        datasets = getattr(dm, "datasets", None) or {}
        rank, world = self.trainer.global_rank, self.trainer.world_size
        table: dict[str, tuple[float, float]] = {}
        for split in ("train", "val"):
            ds = datasets.get(split)
            if ds is None:
                continue
            shard = Subset(ds, range(rank, len(ds), world))
            loader = DataLoader(
                shard,
                batch_size=self.precompute_batch_size,
                collate_fn=getattr(dm, "collate_fn", None) or ds.collate,
            )
            started = time.perf_counter()
            most = math.ceil(math.ceil(len(ds) / world) / self.precompute_batch_size)
            table.update(
                precompute_reference(
                    self.model,
                    repeat_last(loader, most),
                    self.device,
                    self.reduction,
                    ld_alpha=self.ld_alpha,
                    padding_free=self.padding_free,
                    head=self.head,
                )
            )
            log.info(
                "DPO: reference log-probs of %d %s pairs in %.1fs (rank %d)",
                len(shard),
                split,
                time.perf_counter() - started,
                rank,
            )
        if world > 1 and torch.distributed.is_available() and torch.distributed.is_initialized():
            parts: list[Any] = [None] * world
            torch.distributed.all_gather_object(parts, table)
            table = {k: v for part in parts for k, v in part.items()}
        if not table:
            raise RuntimeError("DPO reference=precomputed: the datamodule has no train/val data")
        return table

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        super().on_save_checkpoint(checkpoint)
        if self._ref_table is not None:
            keys = list(self._ref_table)
            checkpoint["dpo_reference"] = {
                "keys": keys,
                "values": torch.tensor([self._ref_table[k] for k in keys], dtype=torch.float64),
                "reduction": self.reduction,
                "ld_alpha": self.ld_alpha,
            }

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        super().on_load_checkpoint(checkpoint)
        saved = checkpoint.get("dpo_reference")
        if saved is not None and self.reference_mode == "precomputed":
            for option, ours, default in (
                ("reduction", self.reduction, "sum"),
                ("ld_alpha", self.ld_alpha, None),
            ):
                theirs = saved.get(option, default)
                if theirs != ours:
                    raise ValueError(
                        f"DPO {option} is {ours!r} but the checkpoint's precomputed reference "
                        f"log-probs were computed with {option}={theirs!r}"
                    )
            values = saved["values"].tolist()
            self._ref_table = {k: (v[0], v[1]) for k, v in zip(saved["keys"], values)}

    # ------------------------------------------------------------------ loss
    def compute_loss(self, batch: dict[str, Any]) -> tuple[Tensor, dict[str, Tensor]]:
        tok, mask = preference_token_logprobs(
            self.model, batch, padding_free=self.padding_free, head=self.head
        )
        pc, pr = reduce_preference(tok, mask, self.reduction, self.ld_alpha)
        rc, rr = self.reference_logprobs(batch)
        b = pc.shape[0]
        counts = mask.sum(-1)
        # the chosen tokens' NLL: plain per-token log-probs, never LD-weighted (TRL's sft)
        nll = (
            response_nll(tok[:b], mask[:b]) if self.rpo_alpha or "sft" in self.loss_types else None
        )
        x = PreferenceLogps(pc, pr, rc.to(pc.dtype), rr.to(pc.dtype), counts[:b], counts[b:], nll)
        out = preference_loss(x, self.loss_types, self.loss_weights, self.loss_options)
        loss = out.loss
        metrics = preference_metrics(out.chosen_rewards, out.rejected_rewards, pc, pr)
        if len(self.loss_types) > 1:
            metrics.update({f"loss/{t}": v.detach() for t, v in out.components.items()})
        if self.rpo_alpha:
            metrics["nll_loss"] = nll.detach()
            loss = loss + self.rpo_alpha * nll
        return loss, metrics
