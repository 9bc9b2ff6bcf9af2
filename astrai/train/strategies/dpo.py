"""Direct preference optimisation (DPO, Rafailov et al. 2023).

The loss pushes the policy's log-ratio against a frozen reference up for the chosen answer
and down for the rejected one::

    loss = -log sigmoid(beta * ((pi_c - ref_c) - (pi_r - ref_r)))

where ``pi_*`` / ``ref_*`` are log-probabilities of the *response* tokens (the loss mask of
the preference batch), summed (``reduction: sum``, the paper's and TRL's) or averaged over
the response (``reduction: mean``: no pull towards longer or shorter answers). The reference is either a frozen copy of the initial policy
(``reference: copy``) or its log-probabilities computed once over the train and val sets
before training (``reference: precomputed``; no second model in memory, the values travel
in the Lightning checkpoint so a resumed run uses the same ones).
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections.abc import Iterable, Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.data import DataLoader, Subset

from astrai.train.module import LMModule, ReferencePolicy, token_logprobs

log = logging.getLogger(__name__)

REFERENCE_MODES = ("copy", "precomputed")
REDUCTIONS = ("sum", "mean")


# ---------------------------------------------------------------------------- pure functions


def sequence_logprobs(token_logps: Tensor, mask: Tensor, reduction: str = "sum") -> Tensor:
    """Sum (``reduction="sum"``) or mean (``"mean"``) of per-token log-probs over the masked
    (response) tokens: ``[B, S] -> [B]``; an empty response gives 0."""
    if reduction not in REDUCTIONS:
        raise ValueError(f"DPO reduction must be one of {REDUCTIONS}, got {reduction!r}")
    mask = mask.to(token_logps.dtype)
    total = (token_logps * mask).sum(-1)
    return total if reduction == "sum" else total / mask.sum(-1).clamp(min=1.0)


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
    logits = (policy_chosen - ref_chosen) - (policy_rejected - ref_rejected)
    losses = -(1.0 - label_smoothing) * F.logsigmoid(beta * logits)
    if label_smoothing:
        losses = losses - label_smoothing * F.logsigmoid(-beta * logits)
    chosen_rewards = beta * (policy_chosen - ref_chosen).detach()
    rejected_rewards = beta * (policy_rejected - ref_rejected).detach()
    return losses.mean(), chosen_rewards, rejected_rewards


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


def preference_logprobs(
    model: nn.Module, batch: Mapping[str, Tensor], reduction: str = "sum"
) -> tuple[Tensor, Tensor]:
    """Response log-probs ``(chosen [B], rejected [B])`` (summed or averaged, see
    :func:`sequence_logprobs`) in one ``[2B, S]`` forward."""
    ids = torch.cat([batch["chosen_input_ids"], batch["rejected_input_ids"]])
    labels = torch.cat([batch["chosen_labels"], batch["rejected_labels"]])
    mask = torch.cat([batch["chosen_loss_mask"], batch["rejected_loss_mask"]])
    # Right padding under a causal mask never changes the logits of real tokens, so no
    # attention mask is needed (and SDPA keeps its fast causal path).
    logits = model(ids)
    seq = sequence_logprobs(
        token_logprobs(logits, labels), mask.bool() & (labels != -100), reduction
    )
    b = batch["chosen_input_ids"].shape[0]
    return seq[:b], seq[b:]


def chosen_nll(policy_chosen: Tensor, batch: Mapping[str, Tensor], reduction: str) -> Tensor:
    """Mean negative log-likelihood per chosen response token over the batch (TRL's RPO
    ``nll_loss``), from the chosen sequence log-probs of :func:`preference_logprobs`."""
    counts = (batch["chosen_loss_mask"].bool() & (batch["chosen_labels"] != -100)).sum(-1)
    counts = counts.to(policy_chosen.dtype)
    total = policy_chosen.sum() if reduction == "sum" else (policy_chosen * counts).sum()
    return -total / counts.sum().clamp(min=1.0)


def precompute_reference(
    model: nn.Module,
    batches: Iterable[Mapping[str, Tensor]],
    device: torch.device,
    reduction: str = "sum",
) -> dict[str, tuple[float, float]]:
    """``{pair_key: (ref_chosen, ref_rejected)}`` over ``batches`` with ``model`` as reference."""
    out: dict[str, tuple[float, float]] = {}
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            for batch in batches:
                batch = {k: v.to(device) if isinstance(v, Tensor) else v for k, v in batch.items()}
                c, r = preference_logprobs(model, batch, reduction)
                for key, vc, vr in zip(batch_pair_keys(batch), c.tolist(), r.tolist()):
                    out[key] = (vc, vr)
    finally:
        model.train(was_training)
    return out


def dpo_metrics(
    chosen_rewards: Tensor, rejected_rewards: Tensor, policy_chosen: Tensor, policy_rejected: Tensor
) -> dict[str, Tensor]:
    """What DPO runs are usually judged by: reward accuracy and margin."""
    return {
        "rewards/chosen": chosen_rewards.mean(),
        "rewards/rejected": rejected_rewards.mean(),
        "rewards/accuracy": (chosen_rewards > rejected_rewards).float().mean(),
        "rewards/margin": (chosen_rewards - rejected_rewards).mean(),
        "logps/chosen": policy_chosen.detach().mean(),
        "logps/rejected": policy_rejected.detach().mean(),
    }


# ---------------------------------------------------------------------------- the module


class DPOModule(LMModule):
    """DPO on preference batches (``chosen_*`` / ``rejected_*``, see ``PreferenceDataset``).

    Args:
        beta: inverse temperature of the implicit reward (0.1 is the usual default).
        label_smoothing: cDPO's label-noise rate (0 = plain DPO).
        reference: ``copy`` keeps a frozen copy of the initial policy (``self.reference``, a
            ``ReferencePolicy``: not in the optimizer, not in checkpoints, moved to the device
            on first use); ``precomputed`` computes the reference log-probs of every train/val
            pair once in ``on_fit_start`` and stores them in the checkpoint instead.
        reference_dtype: e.g. ``bfloat16`` to halve the frozen copy's memory.
        precompute_batch_size: batch size of the precomputation pass.
        reduction: ``sum`` (default; the paper's, TRL's) or ``mean`` of the response tokens'
            log-probs, for the policy and the reference alike.
        rpo_alpha: weight of the chosen responses' negative log-likelihood (mean over their
            tokens) added to the loss: RPO / iterative RPO (Pang et al. 2024; TRL's
            ``rpo_alpha``). Plain DPO lowers the chosen likelihood too when both answers of a
            pair share most tokens (worked solutions that differ in one digit); the NLL term
            keeps the correct answers likely. 0 (default) = plain DPO.

    The other arguments (``model``, ``optimizer``, ``tokenizer``, ``init_from``, ...) are
    ``LMModule``'s; ``init_from`` (typically the SFT export) is applied before the reference
    copy is taken.
    """

    def __init__(
        self,
        *,
        beta: float = 0.1,
        label_smoothing: float = 0.0,
        reference: str = "copy",
        reference_dtype: str | None = None,
        precompute_batch_size: int = 16,
        reduction: str = "sum",
        rpo_alpha: float = 0.0,
        **kwargs: Any,
    ) -> None:
        if rpo_alpha < 0:
            raise ValueError(f"DPO rpo_alpha must be >= 0, got {rpo_alpha}")
        if reduction not in REDUCTIONS:
            raise ValueError(f"DPO reduction must be one of {REDUCTIONS}, got {reduction!r}")
        if reference not in REFERENCE_MODES:
            raise ValueError(f"DPO reference must be one of {REFERENCE_MODES}, got {reference!r}")
        if beta <= 0:
            raise ValueError(f"DPO beta must be > 0, got {beta}")
        if not 0.0 <= label_smoothing < 0.5:
            raise ValueError(f"DPO label_smoothing must be in [0, 0.5), got {label_smoothing}")
        super().__init__(**kwargs)
        self.beta = float(beta)
        self.label_smoothing = float(label_smoothing)
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
                return preference_logprobs(self.reference.on(self.device), batch, self.reduction)
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
            table.update(precompute_reference(self.model, loader, self.device, self.reduction))
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
            }

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        super().on_load_checkpoint(checkpoint)
        saved = checkpoint.get("dpo_reference")
        if saved is not None and self.reference_mode == "precomputed":
            if saved.get("reduction", "sum") != self.reduction:
                raise ValueError(
                    f"DPO reduction is {self.reduction!r} but the checkpoint's precomputed "
                    f"reference log-probs were reduced with {saved.get('reduction', 'sum')!r}"
                )
            values = saved["values"].tolist()
            self._ref_table = {k: (v[0], v[1]) for k, v in zip(saved["keys"], values)}

    # ------------------------------------------------------------------ loss
    def compute_loss(self, batch: dict[str, Any]) -> tuple[Tensor, dict[str, Tensor]]:
        pc, pr = preference_logprobs(self.model, batch, self.reduction)
        rc, rr = self.reference_logprobs(batch)
        loss, cr, rj = dpo_loss(
            pc, pr, rc.to(pc.dtype), rr.to(pc.dtype), self.beta, self.label_smoothing
        )
        metrics = dpo_metrics(cr, rj, pc, pr)
        if self.rpo_alpha:
            nll = chosen_nll(pc, batch, self.reduction)
            metrics["nll_loss"] = nll.detach()
            loss = loss + self.rpo_alpha * nll
        return loss, metrics
