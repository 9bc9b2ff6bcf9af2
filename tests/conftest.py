"""Suite-wide settings: no network, no W&B uploads, deterministic CPU threads."""

import contextlib
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest
import torch

# Triton kernels run on CPU tensors only in Triton's interpreter, which must be chosen
# before anything imports triton (transformers does). Auto backend selection never picks
# it on the CPU; tests that want the Triton path select it explicitly.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
    # Import it now: Triton builds its `tl` library for the interpreter only if
    # TRITON_INTERPRET=1 at its import, and some tests set it to 0 for a while.
    with contextlib.suppress(ImportError):
        import triton  # noqa: F401


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


def _build_model_dir(
    path: Path, texts: list[str], *, vocab_size: int = 300, seed: int = 0, **config: Any
) -> Path:
    """A random-weight model directory (config, safetensors and a BPE tokenizer trained on
    `texts`), as `make train` would export it; `config` overrides the tiny defaults."""
    from astrai.model import ModelConfig, Transformer, save_pretrained
    from astrai.tokenizer import AutoTokenizer

    tok = AutoTokenizer.train(texts, vocab_size=vocab_size)
    defaults = dict(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        max_position_embeddings=256,
    )
    cfg = ModelConfig(vocab_size=len(tok), **{**defaults, **config})
    torch.manual_seed(seed)
    save_pretrained(Transformer(cfg), path, tokenizer=tok)
    return Path(path)


@pytest.fixture(scope="session")
def build_model_dir() -> Callable[..., Path]:
    """Factory of tiny model directories for tests that load one from disk."""
    return _build_model_dir


@pytest.fixture
def decoding_threads(tokenizer, monkeypatch) -> set[str]:
    """Names of the threads on which any request's text is decoded: the directory's
    `tokenizer` fixture hands out recording stream decoders for the test."""
    import threading

    seen: set[str] = set()
    make = tokenizer.stream_decoder

    class Recording:
        def __init__(self, **kw: Any) -> None:
            self.inner = make(**kw)

        def step(self, token_id: int) -> str:
            seen.add(threading.current_thread().name)
            return self.inner.step(token_id)

        def flush(self) -> str:
            seen.add(threading.current_thread().name)
            return self.inner.flush()

    monkeypatch.setattr(tokenizer, "stream_decoder", lambda **kw: Recording(**kw))
    return seen
