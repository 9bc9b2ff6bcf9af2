"""Decoder-only Transformer, its configuration, LoRA and checkpoint directories."""

from astrai.model.config import PRESETS, ConfigError, ModelConfig, preset
from astrai.model.factory import VocabMismatchError, check_vocab, preset_model, pretrained_model
from astrai.model.hub import AutoModel, CheckpointError, load_pretrained, save_pretrained
from astrai.model.lora import LoRAConfig, inject_lora, load_lora, merge_lora, save_lora
from astrai.model.transformer import DecoderBlock, Transformer

__all__ = [
    "PRESETS",
    "AutoModel",
    "CheckpointError",
    "ConfigError",
    "DecoderBlock",
    "LoRAConfig",
    "ModelConfig",
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
