"""On-policy and offline distillation: the student learns the teacher's token distributions
(docs/training.md, "Distillation")."""

from astrai.train.strategies.distill.module import DistillModule
from astrai.train.strategies.distill.options import DistillOptions, make_teacher

__all__ = ["DistillModule", "DistillOptions", "make_teacher"]
