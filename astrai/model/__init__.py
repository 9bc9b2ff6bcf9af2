"""Decoder-only Transformer, its configuration, LoRA and checkpoint directories.

The configuration (`ModelConfig`, presets) and `astrai.model.directory` import no torch;
everything else is imported on first use (`astrai.lazy`), so a command can check a model
directory or a config before it pays for torch.
"""

from typing import TYPE_CHECKING

from astrai.lazy import lazy_exports
from astrai.model.config import PRESETS, ConfigError, ModelConfig, preset

if TYPE_CHECKING:
    from astrai.model.factory import (
        VocabMismatchError,
        check_vocab,
        preset_model,
        pretrained_model,
    )
    from astrai.model.hub import AutoModel, CheckpointError, load_pretrained, save_pretrained
    from astrai.model.lora import LoRAConfig, inject_lora, load_lora, merge_lora, save_lora
    from astrai.model.sandwich import SandwichBlock
    from astrai.model.transformer import DecoderBlock, PostNormBlock, Transformer

__getattr__ = lazy_exports(
    globals(),
    {
        "astrai.model.factory": (
            "VocabMismatchError",
            "check_vocab",
            "preset_model",
            "pretrained_model",
        ),
        "astrai.model.hub": ("AutoModel", "CheckpointError", "load_pretrained", "save_pretrained"),
        "astrai.model.lora": ("LoRAConfig", "inject_lora", "load_lora", "merge_lora", "save_lora"),
        "astrai.model.sandwich": ("SandwichBlock",),
        "astrai.model.transformer": ("DecoderBlock", "PostNormBlock", "Transformer"),
    },
)

__all__ = [
    "PRESETS",
    "AutoModel",
    "CheckpointError",
    "ConfigError",
    "DecoderBlock",
    "LoRAConfig",
    "ModelConfig",
    "PostNormBlock",
    "SandwichBlock",
    "Transformer",
    "VocabMismatchError",
    "check_vocab",
    "inject_lora",
    "load_lora",
    "load_pretrained",
    "merge_lora",
    "preset",
    "preset_model",
    "pretrained_model",
    "save_lora",
    "save_pretrained",
]
