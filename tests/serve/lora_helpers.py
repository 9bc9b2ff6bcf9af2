"""LoRA adapter directories for the serve tests: random, non-zero adapters over a base."""

from __future__ import annotations

import time
from pathlib import Path

import torch

from astrai.model import AutoModel, LoRAConfig, ModelConfig, Transformer, inject_lora, save_lora
from astrai.model.lora import LoRALinear

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def save_random_adapter(model: torch.nn.Module, out: Path, *, r: int, seed: int) -> Path:
    """Wrap `model` with a rank-`r` adapter whose B is random (B starts at zero: a no-op
    adapter would make every test of adapter selection pass by accident) and save it."""
    torch.manual_seed(seed)
    inject_lora(model, LoRAConfig(r=r, lora_alpha=2.0 * r, target_modules=TARGETS))
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, LoRALinear):
                torch.nn.init.normal_(module.lora_B.weight, std=0.2)
    return save_lora(model, out)


def make_adapter(base_dir: Path, out: Path, *, r: int = 4, seed: int = 0) -> Path:
    """An adapter for the model in `base_dir`."""
    return save_random_adapter(AutoModel.from_pretrained(base_dir), out, r=r, seed=seed)


def make_foreign_adapter(out: Path, vocab_size: int) -> Path:
    """An adapter built for another base shape (hidden size 32)."""
    cfg = ModelConfig(
        vocab_size=vocab_size,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    return save_random_adapter(Transformer(cfg), out, r=4, seed=9)


class SlowTransformer(Transformer):
    """A `Transformer` whose forward can be slowed, so a stream outlasts a load/unload."""

    step_delay: float = 0.0

    def forward_packed(self, *args, **kwargs):
        if self.step_delay:
            time.sleep(self.step_delay)
        return super().forward_packed(*args, **kwargs)
