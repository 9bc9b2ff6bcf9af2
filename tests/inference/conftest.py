import sysconfig
from pathlib import Path

import pytest
import torch

from astrai.model import ModelConfig, Transformer
from astrai.tokenizer import AutoTokenizer


@pytest.fixture(scope="session")
def tokenizer() -> AutoTokenizer:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    texts = [p.read_text(errors="ignore") for p in sorted(stdlib.glob("[a-c]*.py"))[:10]]
    return AutoTokenizer.train(texts, vocab_size=384)


@pytest.fixture(scope="session")
def model(tokenizer) -> Transformer:
    cfg = ModelConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        initializer_range=0.15,  # spread-out logits: greedy has no near-ties
    )
    torch.manual_seed(0)
    return Transformer(cfg).eval()


def _greedy(model: Transformer, prompt: list[int], n: int) -> list[int]:
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(model(torch.tensor([ids]))[0, -1].argmax()))
    return ids[len(prompt) :]


@pytest.fixture(scope="session")
def greedy_reference():
    """Greedy decoding by full recomputation of the dense training forward."""
    return _greedy
