"""The Gemma 3 fields of `ModelConfig` (`astrai.model.gemma_config`): checks that name the
field, the attention scale, and the JSON round trip."""

import pytest

from astrai.model import ConfigError, ModelConfig
from astrai.model.gemma_config import HIDDEN_ACTS, attention_scale, local_rope_config
from astrai.model.layers import ACTIVATIONS

BASE = dict(
    vocab_size=97,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    head_dim=16,
)


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        (dict(hidden_act="relu"), "ModelConfig.hidden_act: 'relu' is not one of"),
        (
            dict(hidden_act="gelu_pytorch_tanh", num_experts=4, moe_intermediate_size=8),
            "ModelConfig.hidden_act: 'gelu_pytorch_tanh' is for dense MLPs",
        ),
        (dict(norm_type="layer"), "ModelConfig.norm_type: 'layer' is not one of"),
        (dict(query_pre_attn_scalar=0.0), "ModelConfig.query_pre_attn_scalar: must be positive"),
        (
            dict(rope_local_base_freq=-1.0, sliding_window=4),
            "ModelConfig.rope_local_base_freq: must be positive",
        ),
        (dict(rope_local_base_freq=500.0), "ModelConfig.rope_local_base_freq: .* needs sliding"),
        (
            dict(norm_type="gemma", qk_norm=True, qk_norm_scope="projection"),
            "ModelConfig.norm_type: 'gemma' q/k norms are per head",
        ),
        (dict(norm_position="middle"), "ModelConfig.norm_position: 'middle' is not one of"),
        (dict(scale_embeddings=1), "ModelConfig.scale_embeddings: expected bool"),
    ],
)
def test_bad_gemma_fields_are_refused_naming_the_field(fields, message):
    with pytest.raises(ConfigError, match=message):
        ModelConfig(**BASE, **fields)


def test_attention_scale_uses_query_pre_attn_scalar_when_set():
    assert attention_scale(ModelConfig(**BASE)) == 16**-0.5
    assert attention_scale(ModelConfig(**BASE, query_pre_attn_scalar=256)) == 1 / 16


def test_local_rope_config_has_the_local_base_and_no_scaling():
    cfg = ModelConfig(
        **BASE,
        sliding_window=4,
        rope_local_base_freq=500.0,
        rope_scaling={"rope_type": "linear", "factor": 8.0},
    )
    local = local_rope_config(cfg)
    assert (local.rope_theta, local.rope_scaling) == (500.0, None)
    assert cfg.rope_theta == 10000.0 and cfg.rope_scaling["factor"] == 8.0  # untouched


def test_gemma_fields_round_trip_through_json():
    cfg = ModelConfig(
        **BASE,
        norm_position="sandwich",
        norm_type="gemma",
        qk_norm=True,
        scale_embeddings=True,
        hidden_act="gelu_pytorch_tanh",
        query_pre_attn_scalar=24.0,
        sliding_window=4,
        layer_types=["sliding_attention", "full_attention"],
        rope_local_base_freq=500.0,
    )
    assert ModelConfig.from_json(cfg.to_json()) == cfg


def test_every_hidden_act_has_an_activation():
    assert set(ACTIVATIONS) == set(HIDDEN_ACTS)
