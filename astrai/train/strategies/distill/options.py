"""The options of ``strategy=distill`` (TRL's GKD / distillation-trainer names and meanings),
checked before any model is built, and the one place the teacher is chosen."""

from __future__ import annotations

import dataclasses
import inspect
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from astrai.inference import SamplingParams
from astrai.train.strategies.distill.live_teacher import LiveTeacher, check_teacher_vocab
from astrai.train.strategies.distill.losses import LOSSES
from astrai.train.strategies.distill.stored_teacher import StoredTopKTeacher
from astrai.train.strategies.distill.teacher import DistillLoss, Teacher
from astrai.train.strategies.grpo.sampling import rollout_sampling

__all__ = ["DistillOptions", "make_teacher"]

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class DistillOptions:
    """``strategy.*`` of distillation (docs/training.md, "Distillation").

    ``lmbda`` (TRL GKD's): the probability that a micro-batch is on-policy (the student's own
    completions of the batch's prompts), drawn per micro-batch from a generator seeded with
    ``rollout_seed`` whose state is in the checkpoint; else the dataset's completions.
    ``beta``, ``temperature``: GKD's (:class:`DistillLoss`); ``loss_type``: ``gkd`` |
    ``reverse_kl``. ``max_new_tokens``, ``top_p``, ``top_k``: the student's sampling (the
    temperature is ``temperature``, as TRL's). ``teacher_model_name_or_path``: a teacher export
    (astrai or HF), or None: the batch's stored top-k targets (offline distillation);
    ``teacher_model_init_kwargs``: TRL's, of which ``dtype`` (``torch_dtype``) is read.
    ``loss_add_tail`` (TRL's): the stored top-k's bucket for the mass outside the k ids
    (offline only, :mod:`~astrai.train.strategies.distill.stored_teacher`).
    """

    lmbda: float = 0.5
    beta: float = 0.5
    temperature: float = 1.0
    loss_type: str = "gkd"
    max_new_tokens: int = 128
    top_p: float = 1.0
    top_k: int = 0
    teacher_model_name_or_path: str | None = None
    teacher_dtype: torch.dtype | None = None
    rollout_seed: int = 0
    loss_add_tail: bool = True

    @classmethod
    def parse(
        cls,
        *,
        lmbda: float = 0.5,
        beta: float = 0.5,
        temperature: float = 1.0,
        loss_type: str = "gkd",
        max_new_tokens: int = 128,
        top_p: float = 1.0,
        top_k: int = 0,
        teacher_model_name_or_path: str | None = None,
        teacher_model_init_kwargs: Mapping[str, Any] | None = None,
        rollout_seed: int = 0,
        loss_add_tail: bool = True,
    ) -> DistillOptions:
        """Every option checked, each error naming its key (``strategy.<key>``)."""
        if not (isinstance(lmbda, (int, float)) and 0.0 <= float(lmbda) <= 1.0):
            raise ValueError(f"strategy.lmbda: must be in [0, 1] (TRL GKD's), got {lmbda!r}")
        if not (isinstance(beta, (int, float)) and 0.0 <= float(beta) <= 1.0):
            raise ValueError(f"strategy.beta: must be in [0, 1] (TRL GKD's), got {beta!r}")
        if not (isinstance(temperature, (int, float)) and math.isfinite(temperature)):
            raise ValueError(f"strategy.temperature: must be a number > 0, got {temperature!r}")
        if not temperature > 0:
            raise ValueError(f"strategy.temperature: must be > 0, got {temperature!r}")
        if loss_type not in LOSSES:
            raise ValueError(f"strategy.loss_type: one of {sorted(LOSSES)}, got {loss_type!r}")
        if loss_type == "reverse_kl" and float(lmbda) != 1.0:
            raise ValueError(
                "strategy.loss_type=reverse_kl scores the student's own sampled tokens: it needs "
                f"strategy.lmbda=1 (every micro-batch on-policy), got lmbda={lmbda}"
            )
        if int(max_new_tokens) < 1:
            raise ValueError(f"strategy.max_new_tokens: must be >= 1, got {max_new_tokens}")
        rollout_sampling(int(max_new_tokens), float(temperature), float(top_p), int(top_k))
        kwargs = dict(teacher_model_init_kwargs or {})
        dtype_name = kwargs.pop("dtype", kwargs.pop("torch_dtype", None))
        if kwargs:
            raise ValueError(
                f"strategy.teacher_model_init_kwargs: only dtype is read, got {sorted(kwargs)}"
            )
        if dtype_name is not None and dtype_name not in _DTYPES:
            raise ValueError(
                f"strategy.teacher_model_init_kwargs.dtype: one of {sorted(_DTYPES)}, "
                f"got {dtype_name!r}"
            )
        return cls(
            lmbda=float(lmbda),
            beta=float(beta),
            temperature=float(temperature),
            loss_type=str(loss_type),
            max_new_tokens=int(max_new_tokens),
            top_p=float(top_p),
            top_k=int(top_k),
            teacher_model_name_or_path=(
                str(teacher_model_name_or_path) if teacher_model_name_or_path else None
            ),
            teacher_dtype=_DTYPES[dtype_name] if dtype_name is not None else None,
            rollout_seed=int(rollout_seed),
            loss_add_tail=bool(loss_add_tail),
        )

    @classmethod
    def split(cls, kwargs: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
        """``kwargs`` as (distillation's options, the rest: ``LMModule``'s)."""
        names = set(inspect.signature(cls.parse).parameters)
        mine = {k: v for k, v in kwargs.items() if k in names}
        return mine, {k: v for k, v in kwargs.items() if k not in names}

    @property
    def loss(self) -> DistillLoss:
        return DistillLoss(self.loss_type, self.beta, self.temperature)

    @property
    def sampling(self) -> SamplingParams:
        """The student's rollouts: one completion per prompt, scaled log-probs."""
        params = rollout_sampling(self.max_new_tokens, self.temperature, self.top_p, self.top_k)
        return dataclasses.replace(params, n=1)


def make_teacher(
    options: DistillOptions, student_vocab_size: int, tokenizer: str | None
) -> Teacher:
    """The run's teacher, chosen here only: a live model when a path is set (the loss and its
    vocabulary checked against the student's before its weights load), else the batch's
    stored top-k targets (offline: the dataset's sequences only, so ``lmbda`` must be 0)."""
    path = options.teacher_model_name_or_path
    if path:
        if options.loss_type not in LiveTeacher.loss_types:
            raise ValueError(
                f"strategy.loss_type={options.loss_type}: a live teacher scores only "
                f"{list(LiveTeacher.loss_types)}"
            )
        check_teacher_vocab(path, student_vocab_size, tokenizer)
        return LiveTeacher(path, options.teacher_dtype)
    stored = StoredTopKTeacher(options.loss_add_tail)
    stored.check(options.loss)
    if options.lmbda != 0.0:
        raise ValueError(
            f"strategy.lmbda={options.lmbda}: without a live teacher "
            "(strategy.teacher_model_name_or_path) the teacher is the data's stored top-k, "
            "which scores only the dataset's own completions: set strategy.lmbda=0"
        )
    return stored
