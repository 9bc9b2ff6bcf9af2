"""Training: Hydra-configured Lightning strategies (pretrain, sft, dpo, simpo/cpo, orpo, kto,
reward, grpo).

Run with ``python -m astrai.train [+experiment=NAME] [overrides]`` (see docs/training.md).

The names below are imported on first use: ``astrai.train.module`` pulls in Lightning and
torch (about 5 s on 2 CPU cores, measured), while ``python -m astrai.train --help``, config
composition and the runner need neither (0.1 s).
"""

from __future__ import annotations

import importlib
from typing import Any

#: public name -> the submodule of astrai.train that defines it (the one list of exports)
_EXPORTS = {
    "LMModule": "module",
    "NonFiniteLossError": "module",
    "ReferencePolicy": "module",
    "token_logprobs": "module",
    "CombinedOptimizer": "optim",
    "adamw": "optim",
    "configure_optimizers": "optim",
    "muon": "optim",
    "PretrainModule": "strategies.pretrain",
    "SFTModule": "strategies.sft",
    "DPOModule": "strategies.dpo",
    "CPOModule": "strategies.cpo",
    "ORPOModule": "strategies.orpo",
    "KTOModule": "strategies.kto",
    "RewardModule": "strategies.reward",
    "GRPOModule": "strategies.grpo",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'astrai.train' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"astrai.train.{module}"), name)
    globals()[name] = value
    return value
