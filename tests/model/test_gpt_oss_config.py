"""The GPT-OSS fields of `ModelConfig` (`astrai.model.gpt_oss_config`): bad values are refused
naming the field, and the parameters they add are counted as the built model holds them."""

from __future__ import annotations

import pytest

from astrai.model import ConfigError, ModelConfig, Transformer

BASE = dict(
    vocab_size=64,
    hidden_size=8,
    intermediate_size=16,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=6,
)


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        (dict(num_experts=0, swiglu_limit=7.0), "ModelConfig.swiglu_limit: applies to routed"),
        (dict(num_experts=0, router_bias=True), "ModelConfig.router_bias: applies to routed"),
        (dict(num_experts=0, expert_bias=True), "ModelConfig.expert_bias: applies to routed"),
        (dict(swiglu_limit=-1.0), "ModelConfig.swiglu_limit: must be positive"),
        (dict(swiglu_alpha=0.0), "ModelConfig.swiglu_alpha: must be positive"),
        (dict(swiglu_limit="7"), "ModelConfig.swiglu_limit: expected float or null"),
    ],
)
def test_bad_gpt_oss_fields_are_refused_naming_the_field(fields, message):
    with pytest.raises(ConfigError) as err:
        ModelConfig(**{**BASE, **fields})
    assert message in str(err.value)


def test_sinks_with_mla_are_refused():
    mla = dict(
        attention_type="mla", kv_lora_rank=8, qk_nope_head_dim=4, qk_rope_head_dim=4, v_head_dim=4
    )
    with pytest.raises(ConfigError) as err:
        ModelConfig(**BASE, **mla, attention_sinks=True)
    assert "ModelConfig.attention_sinks" in str(err.value)


@pytest.mark.parametrize("dense_first", [0, 1])
def test_added_parameters_are_counted_and_initialised(dense_first):
    cfg = ModelConfig(
        **BASE,
        first_k_dense_replace=dense_first,
        router_bias=True,
        expert_bias=True,
        swiglu_limit=7.0,
        attention_sinks=True,
    )
    model = Transformer(cfg)
    assert cfg.num_parameters() == sum(p.numel() for p in model.parameters())
    sinks = model.layers[0].self_attn.sinks
    assert sinks.shape == (2,) and bool((sinks != 0).all())  # initialised, as HF's are
