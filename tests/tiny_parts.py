"""The suite's tiny model: one shape (2 layers, 64 wide, grouped-query attention) that the
inference, serve and eval tests build with seed 0, and the text of the 384-token BPE that the
inference and serve tests share (tests/conftest.py's `stdlib_tokenizer`)."""

from __future__ import annotations

import sysconfig
from pathlib import Path
from typing import Any

STDLIB_VOCAB = 384
TINY_SHAPE: dict[str, Any] = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    initializer_range=0.15,  # spread-out logits: greedy has no near-ties
)


def stdlib_texts() -> list[str]:
    """The first ten `[a-c]*.py` files of Python's standard library."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    return [p.read_text(errors="ignore") for p in sorted(stdlib.glob("[a-c]*.py"))[:10]]


def tiny_transformer(vocab_size: int, max_positions: int = 512) -> Any:
    """The tiny shape with random weights from seed 0, in eval mode."""
    import torch

    from astrai.model import ModelConfig, Transformer

    cfg = ModelConfig(vocab_size=vocab_size, max_position_embeddings=max_positions, **TINY_SHAPE)
    torch.manual_seed(0)
    return Transformer(cfg).eval()
