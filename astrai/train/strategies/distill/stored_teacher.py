"""Offline distillation: the teacher's top-k log-probs stored with the data by ``prepare``.

``python -m astrai.data.prepare kind=sft teacher=<export> teacher_top_k=<k>`` stores, for every
target position of every document, the teacher's ``k`` most likely next tokens and their
log-probs (at temperature 1); the SFT dataset hands them to the batch as ``teacher_topk_ids``
and ``teacher_topk_logprobs`` ``[B, L, k]``, entry ``[i, j]`` aligned with ``labels[i, j]``
(the document's token ``j + 1``). No teacher model runs during training.

The loss is TRL's over a top-k support (``ServerDistillationTrainer``, ``loss_top_k`` with
``loss_add_tail``): at each position the student's log-softmax over the whole vocabulary
(logits divided by ``temperature``) is read at the teacher's ``k`` ids; with ``loss_add_tail``
(TRL's default) both distributions get a ``(k + 1)``-th bucket holding the mass outside those
ids, ``log(1 - sum exp(top-k log-probs))`` (the sum clamped below 1 as TRL does), else both
are renormalised over the ``k`` ids. GKD's generalised JSD with ``beta`` (TRL's
``generalized_jsd_loss`` formulas: 0 the forward KL, 1 the reverse KL) is then taken between
these two distributions over ``k`` (+1) outcomes and summed over them. At ``beta = 0`` this is
exactly TRL's top-k forward KL; with ``k = V`` (no tail) it is the full-vocabulary GKD loss.
TRL allows ``beta > 0`` only with ``k = 1`` plus the sampled token; here every ``beta`` uses the
same top-k support (the generalised JSD of the two coarse-grained distributions, never larger
than the full one).

Temperature: the stored log-probs are the teacher's at temperature 1. Renormalised over the
``k`` ids (``loss_add_tail=False``) the teacher's distribution at any temperature is exact
(``softmax(a / T)`` over the ids: the per-position constant cancels); the tail's mass at
another temperature depends on logits that were not stored, so ``loss_add_tail`` needs
``temperature`` 1 (:meth:`StoredTopKTeacher.check` refuses anything else).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from astrai.data.teacher_topk import TOPK_IDS, TOPK_LOGPROBS
from astrai.train.strategies.distill.teacher import DistillLoss, Teacher, TeacherScores

__all__ = ["StoredTopKScores", "StoredTopKTeacher", "topk_divergence"]

#: TRL's clamp of the top-k mass (``_add_tail_bucket``): the tail keeps at least this log-gap
_TAIL_CLAMP = -1e-7


def _with_tail(logp: Tensor) -> Tensor:
    """``[n, k]`` log-probs -> ``[n, k + 1]``: the last bucket ``log(1 - sum exp(logp))``."""
    mass = torch.logsumexp(logp, dim=-1, keepdim=True).clamp(max=_TAIL_CLAMP)
    return torch.cat([logp, torch.log(-torch.expm1(mass))], dim=-1)


def _kl(p_log: Tensor, q_log: Tensor) -> Tensor:
    """``sum_i p_i (log p_i - log q_i)`` per row; a bucket with ``p_i = 0`` adds nothing."""
    p = p_log.exp()
    return torch.where(p > 0, p * (p_log - q_log), torch.zeros_like(p)).sum(-1)


def _generalized_jsd(student: Tensor, teacher: Tensor, beta: float) -> Tensor:
    """GKD's divergence per row of two log-distributions (TRL ``generalized_jsd_loss``)."""
    if beta == 0:
        return _kl(teacher, student)
    if beta == 1:
        return _kl(student, teacher)
    b = torch.tensor(beta, dtype=student.dtype, device=student.device)
    mixture = torch.logsumexp(torch.stack([student + torch.log1p(-b), teacher + torch.log(b)]), 0)
    return beta * _kl(teacher, mixture) + (1 - beta) * _kl(student, mixture)


def topk_divergence(
    student_logits: Tensor,
    topk_ids: Tensor,
    topk_logprobs: Tensor,
    loss: DistillLoss,
    *,
    add_tail: bool = True,
) -> Tensor:
    """The per-position loss ``[n]`` over the teacher's stored top-k support (module docstring).

    ``student_logits`` ``[n, V]`` raw, with their gradient; ``topk_ids`` ``[n, k]`` and
    ``topk_logprobs`` ``[n, k]`` the teacher's ids and log-probs at temperature 1. In fp32 (or
    the logits' dtype when wider).
    """
    check_loss(loss, add_tail)
    dtype = torch.promote_types(student_logits.dtype, torch.float32)
    student = F.log_softmax(student_logits.to(dtype) / loss.temperature, dim=-1)
    student = student.gather(-1, topk_ids.long())
    teacher = topk_logprobs.to(dtype)
    if add_tail:
        student, teacher = _with_tail(student), _with_tail(teacher)
    else:
        student = student - torch.logsumexp(student, dim=-1, keepdim=True)
        teacher = F.log_softmax(teacher / loss.temperature, dim=-1)
    return _generalized_jsd(student, teacher, loss.beta)


def check_loss(loss: DistillLoss, add_tail: bool) -> None:
    """Refuse a loss the stored top-k cannot score (a ValueError naming the key)."""
    if loss.loss_type not in StoredTopKTeacher.loss_types:
        raise ValueError(
            f"distill loss_type={loss.loss_type!r} needs a live teacher "
            f"(teacher_model_name_or_path): stored teacher top-k scores only "
            f"{StoredTopKTeacher.loss_types}"
        )
    if add_tail and loss.temperature != 1.0:
        raise ValueError(
            f"distill temperature={loss.temperature}: the stored teacher top-k log-probs are the "
            f"teacher's at temperature 1, and the mass outside the top-k (loss_add_tail) at "
            f"another temperature is not known; use temperature 1 or loss_add_tail=false"
        )


class StoredTopKScores(TeacherScores):
    """The stored top-k targets of one micro-batch, ``[N, S - 1, k]`` (flat positions index
    the first two dimensions, as :class:`TeacherScores` says)."""

    def __init__(self, topk_ids: Tensor, topk_logprobs: Tensor, add_tail: bool) -> None:
        self.topk_ids = topk_ids
        self.topk_logprobs = topk_logprobs
        self.add_tail = add_tail

    def divergence(
        self, positions: Tensor, student_logits: Tensor, targets: Tensor, loss: DistillLoss
    ) -> Tensor:
        k = self.topk_ids.shape[-1]
        flat = positions.to(self.topk_ids.device)
        ids = self.topk_ids.reshape(-1, k)[flat].to(student_logits.device)
        logprobs = self.topk_logprobs.reshape(-1, k)[flat].to(student_logits.device)
        return topk_divergence(student_logits, ids, logprobs, loss, add_tail=self.add_tail)


class StoredTopKTeacher(Teacher):
    """The teacher's top-k log-probs read from the batch (``prepare ... teacher=``), no model.

    ``loss_add_tail``: TRL's name and default (a bucket for the mass outside the top-k; without
    it a top-1 support gives a loss of 0). Only the dataset's own sequences carry stored
    targets: an on-policy row (a student's completion) is refused.
    """

    loss_types: tuple[str, ...] = ("gkd",)

    def __init__(self, loss_add_tail: bool = True) -> None:
        self.loss_add_tail = loss_add_tail

    def check(self, loss: DistillLoss) -> None:
        """Refuse at start-up a loss this teacher cannot score (``loss_type``, and a
        ``temperature`` other than 1 with ``loss_add_tail``)."""
        check_loss(loss, self.loss_add_tail)

    def score(self, input_ids: Tensor, batch: Mapping[str, Any]) -> StoredTopKScores:
        for key in (TOPK_IDS, TOPK_LOGPROBS):
            if key not in batch:
                raise ValueError(
                    f"the batch has no {key!r}: offline distillation reads the teacher's top-k "
                    f"from data prepared with `python -m astrai.data.prepare kind=sft "
                    f"teacher=<export> teacher_top_k=<k>` (or set a live teacher)"
                )
        ids, logprobs = batch[TOPK_IDS], batch[TOPK_LOGPROBS]
        width = input_ids.shape[1] - 1
        if input_ids.shape[0] != ids.shape[0] or width > ids.shape[1]:
            raise ValueError(
                f"stored teacher top-k {tuple(ids.shape)} does not cover the sequences "
                f"{tuple(input_ids.shape)} (it needs [N, S - 1, k])"
            )
        _check_same_rows(input_ids, batch)
        return StoredTopKScores(ids[:, :width], logprobs[:, :width], self.loss_add_tail)


def _check_same_rows(input_ids: Tensor, batch: Mapping[str, Any]) -> None:
    """The scored rows must be the dataset's: the stored targets belong to its tokens."""
    stored = batch["input_ids"]
    n = min(input_ids.shape[1], stored.shape[1])
    same = input_ids[:, :n].to(stored.device) == stored[:, :n]
    if "attention_mask" in batch:  # padding may differ: only real tokens must agree
        same |= ~batch["attention_mask"][:, :n].bool()
    if not bool(same.all()):
        rows = (~same.all(dim=1)).nonzero().flatten().tolist()
        raise ValueError(
            f"stored teacher top-k: rows {rows[:8]} are not the dataset's sequences (on-policy "
            f"completions?); the stored targets score only the dataset's own tokens, so "
            f"lmbda must be 0 without a live teacher (teacher_model_name_or_path)"
        )
