"""A teacher model run beside the student (on-policy distillation, GKD): frozen, loaded from an
astrai or Hugging Face export directory (TRL's ``teacher_model_name_or_path``), never in the
checkpoint (reloaded from its path on resume).

Its vocabulary must be the student's: :func:`check_teacher_vocab` reads the teacher's
``config.json`` and tokenizer files only (no weights) and is called before either model is
built. Per micro-batch the teacher runs once without gradient to its final-normed hidden states
``[N, S, D]`` (never its ``[N, S, V]`` logits); :class:`LiveScores` projects only the positions
of one chunk through its LM head when the module asks.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from astrai.model import load_pretrained
from astrai.model.hub import read_config
from astrai.tokenizer import AutoTokenizer
from astrai.train.strategies.distill.losses import position_loss, token_logp
from astrai.train.strategies.distill.teacher import DistillLoss, Teacher, TeacherScores

log = logging.getLogger(__name__)

__all__ = ["LiveScores", "LiveTeacher", "check_teacher_vocab"]

_TOKENIZER_FILES = ("tokenizer.json",)


def _tokenizer_vocab(path: Path) -> dict[str, int] | None:
    """The token -> id map of the tokenizer saved in ``path`` (None: none saved there)."""
    if not any((path / name).is_file() for name in _TOKENIZER_FILES):
        return None
    return AutoTokenizer.from_pretrained(str(path)).backend.get_vocab(with_added_tokens=True)


def check_teacher_vocab(
    teacher_path: str | Path, student_vocab_size: int, student_tokenizer: str | Path | None
) -> None:
    """Refuse a teacher whose vocabulary is not the student's, naming both: its
    ``vocab_size`` (config.json) must equal the student model's, and its tokenizer (when the
    export has one) map every token to the same id as the student's tokenizer. Reads configs
    and tokenizer files only."""
    path = Path(teacher_path)
    key = "strategy.teacher_model_name_or_path"
    if not (path / "config.json").is_file():
        raise ValueError(f"{key}: {path} is not a model directory (no config.json)")
    teacher_size = int(read_config(path).vocab_size)
    if teacher_size != int(student_vocab_size):
        raise ValueError(
            f"{key}: the teacher's vocabulary ({path}/config.json: vocab_size={teacher_size}) "
            f"is not the student's (model vocab_size={student_vocab_size}); distillation "
            "compares the two distributions token by token, so both need one vocabulary"
        )
    if student_tokenizer is None:
        return
    theirs = _tokenizer_vocab(path)
    if theirs is None:
        log.info("distill: the teacher %s saves no tokenizer; vocab_size checked only", path)
        return
    ours = AutoTokenizer.from_pretrained(str(student_tokenizer)).backend.get_vocab(
        with_added_tokens=True
    )
    if theirs != ours:
        differ = sorted(set(theirs.items()) ^ set(ours.items()))[:5]
        raise ValueError(
            f"{key}: the teacher's tokenizer ({path}: {len(theirs)} tokens) is not the "
            f"student's ({student_tokenizer}: {len(ours)} tokens); e.g. (token, id) only in "
            f"one of them: {differ}"
        )


class LiveScores(TeacherScores):
    """The teacher's final-normed hidden states of one micro-batch, projected through its
    head only at the positions asked for."""

    def __init__(self, hidden: Tensor, head: nn.Module) -> None:
        self.hidden = hidden[:, :-1].reshape(-1, hidden.shape[-1])  # the [N, S-1] grid
        self.head = head

    @torch.no_grad()
    def logits(self, positions: Tensor) -> Tensor:
        """The teacher's raw logits ``[n, V]`` at ``positions`` of the ``[N, S-1]`` grid."""
        return self.head(self.hidden[positions])

    def divergence(
        self, positions: Tensor, student_logits: Tensor, targets: Tensor, loss: DistillLoss
    ) -> Tensor:
        return position_loss(student_logits, self.logits(positions), targets, loss)

    def target_logp(self, positions: Tensor, targets: Tensor, temperature: float) -> Tensor:
        return token_logp(self.logits(positions), targets, temperature)


class LiveTeacher(Teacher):
    """A frozen teacher loaded from ``path`` (weights in ``dtype``; None: as stored), moved to
    the student's device at its first use. Not a submodule of the training module: it is in no
    optimizer and no checkpoint."""

    loss_types = ("gkd", "reverse_kl")

    def __init__(self, path: str | Path, dtype: torch.dtype | None = None) -> None:
        self.path = Path(path)
        self.model = load_pretrained(self.path, dtype=dtype)
        self.model.requires_grad_(False)
        self.model.eval()
        log.info("distill: teacher loaded from %s", self.path)

    def on(self, device: torch.device) -> nn.Module:
        """The teacher, moved to ``device`` if it is elsewhere."""
        if next(self.model.parameters()).device != device:
            self.model.to(device)
        return self.model

    @torch.no_grad()
    def score(self, input_ids: Tensor, batch: Mapping[str, Any]) -> LiveScores:
        model = self.on(input_ids.device)
        # right-padded rows (no attention mask needed: causal attention never sees the pads)
        hidden = model(input_ids, return_hidden=True)
        return LiveScores(hidden, model.lm_head)
