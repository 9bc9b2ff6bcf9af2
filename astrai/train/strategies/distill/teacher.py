"""Who scores the student's tokens in distillation: a model run beside the student (on-policy
distillation, GKD) or top-k log-probs stored with the data (offline distillation).

The distillation module runs the student once per micro-batch and scores the completion
positions chunk by chunk, never holding the full ``[N, S, V]`` logits of either model; at each
chunk it asks the micro-batch's :class:`TeacherScores` for the per-position divergence of the
student's logits from the teacher's distribution there. Modes are types: a live teacher and
stored top-k targets are two implementations of one interface, chosen once when the module is
built.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from torch import Tensor


@dataclass(frozen=True)
class DistillLoss:
    """What is minimised at each completion position.

    ``loss_type``: ``gkd`` (the generalised Jensen-Shannon divergence of GKD, Agarwal et al.
    2024, over the vocabulary) or ``reverse_kl`` (the token-level reverse KL at the student's
    own sampled token). ``beta``: GKD's interpolation (TRL's name and meaning: 0 is the forward
    KL(teacher || student), 1 the reverse KL(student || teacher)). ``temperature``: both
    models' logits are divided by it (TRL's).
    """

    loss_type: str = "gkd"
    beta: float = 0.5
    temperature: float = 1.0


class TeacherScores(ABC):
    """The teacher's view of one micro-batch of sequences ``[N, S]``."""

    @abstractmethod
    def divergence(
        self, positions: Tensor, student_logits: Tensor, targets: Tensor, loss: DistillLoss
    ) -> Tensor:
        """The per-position loss ``[n]`` of the student at ``positions``.

        ``positions``: ``[n]`` flat indices into the micro-batch's ``[N, S - 1]`` grid of targets
        (position ``j`` of row ``i`` predicts ``input_ids[i, j + 1]``); ``student_logits``:
        ``[n, V]``, raw (before the temperature), with their gradient; ``targets``: ``[n]`` the
        tokens at those positions (what ``reverse_kl`` scores).
        """

    def target_logp(self, positions: Tensor, targets: Tensor, temperature: float) -> Tensor | None:
        """The teacher's log-prob ``[n]`` of ``targets`` at ``positions`` (of its logits divided
        by ``temperature``, no gradient): the ``distill/teacher_logp`` metric. None where the
        teacher does not know it (a stored top-k that may not hold the target)."""
        return None


class Teacher(ABC):
    """Makes the :class:`TeacherScores` of each micro-batch."""

    #: the ``DistillLoss.loss_type`` values this teacher can score (checked at start-up)
    loss_types: tuple[str, ...] = ("gkd", "reverse_kl")

    @abstractmethod
    def score(self, input_ids: Tensor, batch: Mapping[str, Any]) -> TeacherScores:
        """The teacher's scores of ``input_ids`` ``[N, S]`` (no gradient). ``batch`` is the
        loader's micro-batch the sequences came from (stored targets travel in it)."""
