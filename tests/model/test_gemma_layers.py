"""Gemma 3's layers (`astrai.model.gemma_layers`) against transformers' own modules: the (1 + w)
norm in fp32 and bf16, the embedding scale rounded to bf16, and the per-layer-type RoPE; and
the factories choose them from the config (nothing else changes for other families)."""

import pytest
import torch
import transformers
from torch import nn
from transformers.models.gemma3 import modeling_gemma3 as hf_gemma3

from astrai.model import ModelConfig, Transformer
from astrai.model.gemma_layers import (
    GemmaRMSNorm,
    LayerTypeRotary,
    ScaledEmbedding,
    make_embedding,
    make_rotary,
    norm_class,
)
from astrai.model.layers import ACTIVATIONS, RMSNorm
from astrai.model.rope import RotaryEmbedding

BASE = dict(
    vocab_size=97,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
)
GEMMA = dict(
    norm_position="sandwich",
    norm_type="gemma",
    qk_norm=True,
    scale_embeddings=True,
    hidden_act="gelu_pytorch_tanh",
    sliding_window=4,
    layer_types=["sliding_attention", "sliding_attention", "full_attention"],
    rope_local_base_freq=500.0,
)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gemma_norm_equals_transformers(dtype):
    ours, ref = GemmaRMSNorm(48, 1e-6), hf_gemma3.Gemma3RMSNorm(48, eps=1e-6)
    assert torch.equal(ours.weight, torch.zeros(48))  # the identity scale, as HF's
    with torch.no_grad():
        ours.weight.normal_(0, 0.5, generator=torch.Generator().manual_seed(0))
        ref.weight.copy_(ours.weight)
    ours.to(dtype), ref.to(dtype)
    x = torch.randn(3, 5, 48, generator=torch.Generator().manual_seed(1)).to(dtype) * 4
    with torch.no_grad():
        torch.testing.assert_close(
            ours(x), ref(x), atol=1e-5 if dtype == torch.float32 else 0, rtol=0
        )
        assert ours(x).dtype == dtype


def test_embedding_scale_is_rounded_to_the_weight_dtype_as_transformers_does():
    hidden = 3072  # sqrt = 55.43, which bf16 rounds to 55.5
    ours = ScaledEmbedding(11, hidden, hidden**0.5).to(torch.bfloat16)
    ref = hf_gemma3.Gemma3TextScaledWordEmbedding(11, hidden, 0, embed_scale=hidden**0.5)
    ref = ref.to(torch.bfloat16)
    with torch.no_grad():
        ref.weight.copy_(ours.weight)
        x = torch.tensor([[1, 4, 9]])
        assert torch.equal(ours(x), ref(x))
        assert torch.equal(ours(x), ours.weight[x] * 55.5)


def test_sliding_layers_rotate_with_their_own_base_as_transformers_does():
    cfg = ModelConfig(**BASE, **GEMMA, rope_scaling={"rope_type": "linear", "factor": 2.0})
    rotary = make_rotary(cfg)
    assert isinstance(rotary, LayerTypeRotary)
    ref_cfg = transformers.Gemma3TextConfig(
        **BASE,
        sliding_window=4,
        layer_types=GEMMA["layer_types"],
        rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 500.0},
            "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0},
        },
    )
    ref = hf_gemma3.Gemma3RotaryEmbedding(ref_cfg)
    pos = torch.tensor([[0, 3, 7, 30]])
    tables = rotary.layer_tables(pos)
    x = torch.zeros(1, 4, 16)
    for (cos, sin), kind in zip(tables, GEMMA["layer_types"]):
        ref_cos, ref_sin = ref(x, pos, kind)  # HF repeats the half-table: [cos, cos]
        torch.testing.assert_close(cos, ref_cos[..., :8], atol=1e-6, rtol=0)
        torch.testing.assert_close(sin, ref_sin[..., :8], atol=1e-6, rtol=0)
    assert not torch.allclose(tables[0][0], tables[2][0])  # the two types do differ


def test_factories_choose_gemma_types_only_when_the_config_asks():
    plain = ModelConfig(**BASE)
    assert norm_class(plain) is RMSNorm
    assert type(make_embedding(plain)) is nn.Embedding
    assert type(make_rotary(plain)) is RotaryEmbedding
    gemma = ModelConfig(**BASE, **GEMMA)
    assert norm_class(gemma) is GemmaRMSNorm
    assert isinstance(make_embedding(gemma), ScaledEmbedding)
    model = Transformer(gemma)
    norms = [m for m in model.modules() if isinstance(m, RMSNorm)]
    assert len(norms) == 3 * (4 + 2) + 1  # four per sandwich block, q/k per head, final
    assert all(type(m) is GemmaRMSNorm and not m.weight.any() for m in norms)
    assert model.layers[0].mlp.act is ACTIVATIONS["gelu_pytorch_tanh"]
    assert model.num_parameters() == gemma.num_parameters()


def test_mlp_activations_are_transformers_ones():
    from transformers.activations import ACT2FN

    x = torch.randn(64, generator=torch.Generator().manual_seed(0)) * 3
    for name, act in ACTIVATIONS.items():
        torch.testing.assert_close(act(x), ACT2FN[name](x), atol=0, rtol=0)
