"""Model factories: what a `conf/model/` option builds (Hydra, `_partial_: true`).

A factory rather than a model: a strategy calls it once for the live weights, while the
training entry point and the benchmarks call it with `device="meta"` or their own device.
With a tokenizer, the factory checks that its ids fit the embedding table first: a silent
mismatch would index out of range mid-run.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from astrai.model.config import preset
from astrai.model.hub import load_pretrained, read_config
from astrai.model.transformer import Transformer

if TYPE_CHECKING:
    from astrai.tokenizer import AutoTokenizer

__all__ = ["VocabMismatchError", "check_vocab", "preset_model", "pretrained_model"]


class VocabMismatchError(ValueError):
    """The tokenizer produces ids the model's embedding table cannot hold."""


def check_vocab(vocab_size: int, tokenizer: AutoTokenizer, *, source: str = "model") -> None:
    """Raise `VocabMismatchError` when the tokenizer has more ids than the model's vocabulary
    (a silent mismatch would index out of range mid-run)."""
    n = len(tokenizer)
    if n > vocab_size:
        raise VocabMismatchError(
            f"tokenizer has {n} tokens but {source} has vocab_size={vocab_size}; "
            f"use a model with vocab_size >= {n} (e.g. +model.vocab_size={n}) "
            f"or a tokenizer trained with a smaller vocabulary"
        )


def preset_model(
    name: str,
    *,
    device: str | torch.device | None = None,
    tokenizer: AutoTokenizer | None = None,
    **overrides: Any,
) -> Transformer:
    """A fresh `Transformer` from the preset `name` (`astrai.model.PRESETS`) with field
    `overrides` (`conf/model/astrai-5m.yaml`: `+model.num_hidden_layers=6`). The tokenizer,
    when given, must fit the vocabulary; `device="meta"` allocates nothing."""
    config = preset(name, **overrides)
    if tokenizer is not None:
        check_vocab(config.vocab_size, tokenizer, source=f"model preset {name!r}")
    if device is None:
        return Transformer(config)
    with torch.device(device):
        return Transformer(config)


def pretrained_model(
    path: str | Path,
    *,
    device: str | torch.device | None = None,
    tokenizer: AutoTokenizer | None = None,
) -> Transformer:
    """The model of a directory (astrai export or HF Llama/Qwen2/Qwen3/Mistral), in fp32 and
    train mode (`conf/model/pretrained.yaml`). With `device="meta"` only `config.json` is
    read: the shapes without the weights."""
    config = read_config(path)
    if tokenizer is not None:
        check_vocab(config.vocab_size, tokenizer, source=f"model directory {path}")
    if device is not None and torch.device(device).type == "meta":
        with torch.device("meta"):
            return Transformer(config)
    model = load_pretrained(path, device=device or "cpu", dtype=torch.float32)
    return model.train()
