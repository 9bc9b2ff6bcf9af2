"""GPT-OSS fields of `ModelConfig` (attention sinks, router and expert biases, the clamped
SwiGLU): their checks and the parameters they add. Kept apart, as moe_config is, so that
`config.py` stays torch-free and short."""

from __future__ import annotations

from typing import Any

from astrai.model.moe_config import expert_size, moe_layer


def gpt_oss_problems(config: Any) -> list[str]:
    """What is wrong with `config`'s GPT-OSS fields (each message names the field)."""
    problems = []
    moe_only = {"router_bias": config.router_bias, "expert_bias": config.expert_bias}
    moe_only["swiglu_limit"] = config.swiglu_limit is not None
    for name, used in moe_only.items():
        if used and config.num_experts == 0:
            problems.append(f"ModelConfig.{name}: applies to routed experts; num_experts is 0")
    if config.swiglu_limit is not None and config.swiglu_limit <= 0:
        problems.append(f"ModelConfig.swiglu_limit: must be positive, got {config.swiglu_limit}")
    if config.swiglu_alpha <= 0:
        problems.append(f"ModelConfig.swiglu_alpha: must be positive, got {config.swiglu_alpha}")
    if config.attention_sinks and config.attention_type == "mla":
        problems.append("ModelConfig.attention_sinks: not supported with attention_type='mla'")
    return problems


def gpt_oss_param_delta(config: Any) -> int:
    """Parameters these fields add: one sink per head and layer, the router's bias and the
    experts' biases on every sparse layer."""
    total = config.num_hidden_layers * config.num_attention_heads if config.attention_sinks else 0
    per_sparse = config.num_experts if config.router_bias else 0
    if config.expert_bias:
        per_sparse += config.num_experts * (2 * expert_size(config) + config.hidden_size)
    sparse = sum(moe_layer(config, i) for i in range(config.num_hidden_layers))
    return total + sparse * per_sparse


__all__ = ["gpt_oss_param_delta", "gpt_oss_problems"]
