"""Model factories: what a `conf/model/` option builds (Hydra, `_partial_: true`).

A factory rather than a model: a strategy calls it once for the live weights, while the
training entry point and the benchmarks call it with `device="meta"` or their own device.
With a tokenizer, the factory checks that its ids fit the embedding table first: a silent
mismatch would index out of range mid-run.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from astrai.model.config import preset
from astrai.model.hub import load_pretrained, read_config
from astrai.model.transformer import Transformer

if TYPE_CHECKING:
    from astrai.tokenizer import AutoTokenizer

__all__ = [
    "VocabMismatchError",
    "check_compile_toolchain",
    "check_vocab",
    "preset_model",
    "pretrained_model",
]

#: C++ compilers torch.compile's CPU backend (Inductor) can build its kernels with.
CXX_COMPILERS = ("g++", "c++", "clang++")


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


def check_compile_toolchain() -> None:
    """`model.compile=true` needs a C++ compiler when no GPU is present (Inductor builds its
    CPU kernels with one): without it, fail now, naming the option, rather than at the first
    training step with a compiler traceback."""
    if torch.cuda.is_available() or os.environ.get("CXX"):
        return
    if not any(shutil.which(cxx) for cxx in CXX_COMPILERS):
        raise RuntimeError(
            "model.compile=true: torch.compile on CPU needs a C++ compiler "
            f"({', '.join(CXX_COMPILERS)} or $CXX) and none is on PATH; install one "
            "(apt-get install g++) or set model.compile=false"
        )


def _compile_flag(model: Transformer, compile: bool) -> Transformer:
    if compile:
        check_compile_toolchain()
    model.compile_training = bool(compile)
    return model


def preset_model(
    name: str,
    *,
    device: str | torch.device | None = None,
    tokenizer: AutoTokenizer | None = None,
    compile: bool = False,
    **overrides: Any,
) -> Transformer:
    """A fresh `Transformer` from the preset `name` (`astrai.model.PRESETS`) with field
    `overrides` (`conf/model/astrai-5m.yaml`: `+model.num_hidden_layers=6`). The tokenizer,
    when given, must fit the vocabulary; `device="meta"` allocates nothing. `compile`
    (`model.compile=true`) marks the model for a torch.compile'd training forward
    (`LMModule.configure_model`)."""
    config = preset(name, **overrides)
    if tokenizer is not None:
        check_vocab(config.vocab_size, tokenizer, source=f"model preset {name!r}")
    if device is None:
        return _compile_flag(Transformer(config), compile)
    with torch.device(device):
        return _compile_flag(Transformer(config), compile)


def pretrained_model(
    path: str | Path,
    *,
    device: str | torch.device | None = None,
    tokenizer: AutoTokenizer | None = None,
    compile: bool = False,
) -> Transformer:
    """The model of a directory (astrai export or HF Llama/Qwen2/Qwen3/Mistral), in fp32 and
    train mode (`conf/model/pretrained.yaml`). With `device="meta"` only `config.json` is
    read: the shapes without the weights. `compile` as in `preset_model`."""
    config = read_config(path)
    if tokenizer is not None:
        check_vocab(config.vocab_size, tokenizer, source=f"model directory {path}")
    if device is not None and torch.device(device).type == "meta":
        with torch.device("meta"):
            return _compile_flag(Transformer(config), compile)
    model = load_pretrained(path, device=device or "cpu", dtype=torch.float32)
    return _compile_flag(model.train(), compile)
