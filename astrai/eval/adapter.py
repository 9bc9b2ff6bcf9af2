"""Evaluating a LoRA adapter over its base model: ``python -m astrai.eval adapter=DIR``.

The base directory loads as usual and the engine serves the adapter from one slot
(`astrai.inference.adapters`), so every suite's requests name it through
`SamplingParams.adapter` and nothing is merged: what is measured is what the server
serves for ``model: "<name>"``. The directory is checked here, without torch, before any
model is loaded; the engine checks its tensors against the base when it loads it.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["ADAPTER_CONFIG", "ADAPTER_WEIGHTS", "EvalAdapter", "check_adapter", "lora_settings"]

# astrai.model.lora's names, repeated so that this check needs no torch import
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"


@dataclass(frozen=True)
class EvalAdapter:
    """A checked adapter directory: its `path`, the `name` requests use, its rank `r`."""

    path: Path
    name: str
    rank: int


def check_adapter(path: str | os.PathLike, key: str = "adapter") -> EvalAdapter:
    """The adapter at `path`, or a ValueError naming `key` and the file at fault (a missing
    directory or file, a config that is not JSON or has no positive rank)."""
    root = Path(path).expanduser()
    if not root.is_dir():
        raise ValueError(f"{key}={path}: not a directory (expected a LoRA adapter directory)")
    config_file, weights = root / ADAPTER_CONFIG, root / ADAPTER_WEIGHTS
    for file in (config_file, weights):
        if not file.is_file():
            raise ValueError(f"{key}={path}: LoRA adapter file not found: {file}")
    try:
        data = json.loads(config_file.read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise ValueError(f"{key}={path}: {config_file}: not valid JSON ({err})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{key}={path}: {config_file}: expected a JSON object")
    rank = data.get("r", 8)  # LoRAConfig's default, as the engine reads it
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise ValueError(f"{key}={path}: {config_file}: r must be a positive int, got {rank!r}")
    return EvalAdapter(path=root, name=root.resolve().name or "adapter", rank=rank)


def lora_settings(engine_lora: Mapping[str, Any] | None, adapter: EvalAdapter) -> dict[str, Any]:
    """The engine's `lora` settings for evaluating `adapter`: one slot of its rank, over
    any other `engine.lora` keys given (`max_cpu_loras`)."""
    return {**dict(engine_lora or {}), "max_loras": 1, "max_lora_rank": max(1, adapter.rank)}
