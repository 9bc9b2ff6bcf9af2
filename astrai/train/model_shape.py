"""The model's `ModelConfig` from the composed `model` node alone: no weights, no module, no
torch. The pre-run checks (the vocabulary against the tokenizer) and the memory plan read
the shape here, before anything loads."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from omegaconf import DictConfig, OmegaConf

from astrai.model.config import FACTORY_OPTIONS, ModelConfig, preset

__all__ = ["ModelShape", "export_shape", "model_shape"]

PRESET_FACTORY = "astrai.model.preset_model"
PRETRAINED_FACTORY = "astrai.model.pretrained_model"


@dataclass(frozen=True)
class ModelShape:
    """A model's configuration and where it came from (for messages)."""

    config: ModelConfig
    source: str


def export_shape(path: str) -> ModelShape:
    """The configuration of a model directory (an astrai or Hugging Face export) from its
    `config.json` alone: `model.path`'s, and a second model's (a distillation teacher, a PPO
    critic's start). A directory without one raises `FileNotFoundError`."""
    from astrai.model.hub import read_config

    return ModelShape(read_config(path), f"model directory {path}")


def model_shape(model: DictConfig | None) -> ModelShape | None:
    """The configuration a `model` group builds: a preset (with its overrides) or a model
    directory's `config.json`; None when the node names neither (a directory still `???`,
    another factory). A bad preset name or field raises (`KeyError`, `ConfigError`)."""
    if model is None:
        return None
    target = str(model.get("_target_", ""))
    if target == PRETRAINED_FACTORY:
        path = OmegaConf.select(model, "path", default=None, throw_on_missing=False)
        if not path or OmegaConf.is_missing(model, "path"):
            return None
        return export_shape(str(path))
    if target != PRESET_FACTORY:
        return None
    fields: dict[str, Any] = OmegaConf.to_container(model, resolve=True)  # type: ignore[assignment]
    fields = {k: v for k, v in fields.items() if not k.startswith("_")}
    # the factory's own options (device, compile, ...) are not model config fields
    name = fields.pop("name")
    fields = {k: v for k, v in fields.items() if k not in FACTORY_OPTIONS}
    return ModelShape(preset(name, **fields), f"model preset {name!r}")
