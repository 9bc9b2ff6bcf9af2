import pytest
import torch

from astrai.model import ModelConfig, Transformer


@pytest.fixture
def tiny_config() -> ModelConfig:
    return ModelConfig(
        vocab_size=97,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
    )


@pytest.fixture
def tiny_model(tiny_config) -> Transformer:
    torch.manual_seed(0)
    return Transformer(tiny_config).eval()
