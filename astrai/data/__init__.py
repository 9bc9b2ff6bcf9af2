"""Data layer: storages, preprocessing, datasets, resumable sampling, built-in data, rewards.

``python -m astrai.data.prepare`` turns raw text / chat / preference / prompt records into
HDF5 storages; the datasets read them lazily; ``AstraiDataModule`` serves them to Lightning
and carries the data position in checkpoints.

Names are imported on first use, so that ``python -m astrai.data.prepare`` does not pay for
importing Lightning and torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_EXPORTS = {
    "AstraiDataModule": "datamodule",
    "IGNORE_INDEX": "datasets",
    "PreferenceDataset": "datasets",
    "PretrainDataset": "datasets",
    "PromptDataset": "datasets",
    "SFTDataset": "datasets",
    "collate_lm": "datasets",
    "collate_preference": "datasets",
    "collate_prompt": "datasets",
    "PrepareResult": "prepare",
    "REWARDS": "rewards",
    "get_reward": "rewards",
    "register_reward": "rewards",
    "ResumableSampler": "sampler",
    "DataError": "storage",
    "FingerprintMismatchError": "storage",
    "H5Storage": "storage",
    "H5Writer": "storage",
    "JsonStorage": "storage",
    "Storage": "storage",
    "open_storage": "storage",
    "write_jsonl": "storage",
}

__all__ = [
    "IGNORE_INDEX",
    "REWARDS",
    "AstraiDataModule",
    "DataError",
    "FingerprintMismatchError",
    "H5Storage",
    "H5Writer",
    "JsonStorage",
    "PreferenceDataset",
    "PrepareResult",
    "PretrainDataset",
    "PromptDataset",
    "ResumableSampler",
    "SFTDataset",
    "Storage",
    "collate_lm",
    "collate_preference",
    "collate_prompt",
    "get_reward",
    "open_storage",
    "register_reward",
    "write_jsonl",
]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'astrai.data' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"astrai.data.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


if TYPE_CHECKING:
    from astrai.data.datamodule import AstraiDataModule
    from astrai.data.datasets import (
        IGNORE_INDEX,
        PreferenceDataset,
        PretrainDataset,
        PromptDataset,
        SFTDataset,
        collate_lm,
        collate_preference,
        collate_prompt,
    )
    from astrai.data.prepare import PrepareResult
    from astrai.data.rewards import REWARDS, get_reward, register_reward
    from astrai.data.sampler import ResumableSampler
    from astrai.data.storage import (
        DataError,
        FingerprintMismatchError,
        H5Storage,
        H5Writer,
        JsonStorage,
        Storage,
        open_storage,
        write_jsonl,
    )
