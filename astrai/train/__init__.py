"""Training: Hydra-configured Lightning strategies (pretrain, sft, dpo, grpo).

Run with ``python -m astrai.train [+experiment=NAME] [overrides]`` (see docs/training.md).
Names are imported on first use so that ``import astrai.train`` stays cheap.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_EXPORTS = {
    "LMModule": "module",
    "NonFiniteLossError": "module",
    "VocabMismatchError": "module",
    "build_model": "module",
    "CombinedOptimizer": "optim",
    "build_optimizer": "optim",
    "configure_optimizers": "optim",
    "lr_lambda": "optim",
    "PretrainModule": "strategies.pretrain",
    "SFTModule": "strategies.sft",
}

__all__ = [
    "CombinedOptimizer",
    "LMModule",
    "NonFiniteLossError",
    "PretrainModule",
    "SFTModule",
    "VocabMismatchError",
    "build_model",
    "build_optimizer",
    "configure_optimizers",
    "lr_lambda",
]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'astrai.train' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"astrai.train.{module}"), name)
    globals()[name] = value
    return value


if TYPE_CHECKING:
    from astrai.train.module import LMModule, NonFiniteLossError, VocabMismatchError, build_model
    from astrai.train.optim import (
        CombinedOptimizer,
        build_optimizer,
        configure_optimizers,
        lr_lambda,
    )
    from astrai.train.strategies.pretrain import PretrainModule
    from astrai.train.strategies.sft import SFTModule
