"""Hugging Face translation of OLMo 2 (`Olmo2ForCausalLM`): post-norm blocks and q/k RMSNorm
over the whole projection (`ModelConfig.norm_position="post"`, `qk_norm_scope="projection"`).

OLMo 2's tensor names are ours already (`post_attention_layernorm`,
`post_feedforward_layernorm`, `self_attn.q_norm` of size heads * head_dim), so only the
config translates; `hub.py` calls these.
"""

from __future__ import annotations

from typing import Any

from astrai.model.config import ConfigError, ModelConfig

OLMO2_ARCHITECTURES = {"olmo2": "Olmo2ForCausalLM"}


def config_fields(data: dict[str, Any], model_type: str | None, source: str) -> dict[str, Any]:
    """The `ModelConfig` fields in which an OLMo 2 `config.json` differs from Llama's; {} for
    any other model_type."""
    if model_type not in OLMO2_ARCHITECTURES:
        return {}
    return dict(qk_norm=True, qk_norm_scope="projection", norm_position="post")


def is_olmo2(config: ModelConfig) -> bool:
    """Whether `config` uses one of OLMo 2's block variants (only OLMo 2 can represent it)."""
    return config.norm_position == "post" or config.qk_norm_scope == "projection"


def hf_olmo2_model_type(config: ModelConfig) -> str:
    """'olmo2' when OLMo 2 computes `config` exactly, else a ConfigError saying why not."""
    if not (
        config.norm_position == "post" and config.qk_norm and config.qk_norm_scope == "projection"
    ):
        raise ConfigError(
            "norm_position='post' / qk_norm_scope='projection' export only as OLMo 2, which "
            "needs both, with qk_norm=true"
        )
    if config.attention_bias != config.o_proj_bias or config.partial_rotary_factor != 1:
        raise ConfigError(
            "OLMo 2 has no attention_bias != o_proj_bias and no partial_rotary_factor"
        )
    if config.sliding_window is not None:
        raise ConfigError("ModelConfig.sliding_window: OLMo 2 has no sliding-window attention")
    if config.num_experts:
        raise ConfigError("OLMo 2 has no mixture of experts (num_experts must be 0)")
    return "olmo2"


def config_to_hf_fields(config: ModelConfig, model_type: str) -> dict[str, Any]:
    """OLMo 2's own `config.json` fields; {} for any other model_type."""
    if model_type not in OLMO2_ARCHITECTURES:
        return {}
    return {"attention_bias": config.attention_bias}
