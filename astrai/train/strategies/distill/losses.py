"""The per-position distillation losses: given the student's and the teacher's logits at the
same ``n`` positions (one chunk of a micro-batch), each returns ``[n]``.

``gkd``: the generalised Jensen-Shannon divergence of GKD (Agarwal et al. 2024, Eq. 1), summed
over the vocabulary, exactly as TRL's ``GKDTrainer.generalized_jsd_loss`` computes it before its
reduction (``beta`` 0: forward KL(teacher || student), 1: reverse KL(student || teacher); both
logits divided by ``temperature``). The module reduces it as TRL's ``batchmean`` with labels:
the sum over the micro-batch's completion positions over their count.

``reverse_kl``: the token-level reverse KL at the student's own sampled token ``y``, as
on-policy distillation (Thinking Machines, 2025; Qwen3) trains it: ``k = log p_s(y) - log
p_t(y)`` is a per-token estimate of KL(student || teacher) whose gradient is the score-function
one, ``k * grad log p_s(y)`` (the per-token advantage ``-k``, no discount). The value returned
is ``k`` itself. It assumes ``y`` was sampled from the student (``lmbda: 1``, checked in the
options). TRL's distillation trainer has no such token-level loss (its ``beta: 1`` is the full
reverse KL over the vocabulary, our ``gkd`` with ``beta: 1``); the name is ours.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from astrai.train.strategies.distill.teacher import DistillLoss

__all__ = ["LOSSES", "generalized_jsd", "position_loss", "token_logp", "token_reverse_kl"]


def _wide(logits: Tensor) -> Tensor:
    """fp32, or the logits' dtype when wider (fp64 in the reference tests)."""
    return logits.to(torch.promote_types(logits.dtype, torch.float32))


def generalized_jsd(
    student_logits: Tensor, teacher_logits: Tensor, beta: float, temperature: float = 1.0
) -> Tensor:
    """GKD's generalised JSD per position ``[n]`` of logits ``[n, V]`` (TRL's arithmetic)."""
    s = F.log_softmax(_wide(student_logits) / temperature, dim=-1)
    t = F.log_softmax(_wide(teacher_logits) / temperature, dim=-1)
    if beta == 0:
        jsd = F.kl_div(s, t, reduction="none", log_target=True)
    elif beta == 1:
        jsd = F.kl_div(t, s, reduction="none", log_target=True)
    else:
        b = torch.tensor(beta, dtype=s.dtype, device=s.device)
        mixture = torch.logsumexp(torch.stack([s + torch.log1p(-b), t + torch.log(b)]), dim=0)
        kl_teacher = F.kl_div(mixture, t, reduction="none", log_target=True)
        kl_student = F.kl_div(mixture, s, reduction="none", log_target=True)
        jsd = b * kl_teacher + (1 - b) * kl_student
    return jsd.sum(-1)


def token_logp(logits: Tensor, targets: Tensor, temperature: float = 1.0) -> Tensor:
    """``log softmax(logits / temperature)`` at ``targets`` ``[n]``."""
    logp = F.log_softmax(_wide(logits) / temperature, dim=-1)
    return logp.gather(-1, targets[:, None].long())[:, 0]


def token_reverse_kl(
    student_logits: Tensor, teacher_logits: Tensor, targets: Tensor, temperature: float = 1.0
) -> Tensor:
    """Per position ``[n]``: the value ``k = log p_s(y) - log p_t(y)``, the gradient
    ``k * grad log p_s(y)`` (module docstring)."""
    s = token_logp(student_logits, targets, temperature)
    t = token_logp(teacher_logits.detach(), targets, temperature)
    k = (s - t).detach()
    return k + k * (s - s.detach())


#: ``loss_type`` -> ``(student_logits, teacher_logits, targets, loss) -> [n]``
LOSSES: dict[str, Callable[[Tensor, Tensor, Tensor, DistillLoss], Tensor]] = {
    "gkd": lambda s, t, y, loss: generalized_jsd(s, t, loss.beta, loss.temperature),
    "reverse_kl": lambda s, t, y, loss: token_reverse_kl(s, t, y, loss.temperature),
}


def position_loss(
    student_logits: Tensor, teacher_logits: Tensor, targets: Tensor, loss: DistillLoss
) -> Tensor:
    """The per-position loss ``[n]`` of ``loss.loss_type`` (a name of :data:`LOSSES`)."""
    return LOSSES[loss.loss_type](student_logits, teacher_logits, targets, loss)
