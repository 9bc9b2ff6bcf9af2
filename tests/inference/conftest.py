import pytest
import torch
from tiny_parts import tiny_transformer

from astrai.model import Transformer
from astrai.tokenizer import AutoTokenizer


@pytest.fixture(scope="session")
def tokenizer(stdlib_tokenizer) -> AutoTokenizer:
    return stdlib_tokenizer


@pytest.fixture(scope="session")
def model(tokenizer) -> Transformer:
    return tiny_transformer(len(tokenizer))


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
