"""Gemma 3 fields of `ModelConfig` (activation, norm type, embedding scale, attention scale,
local RoPE base) and their checks, kept apart so that `config.py` stays torch-free and short.

Each field is a type choice the layers read once at construction (`astrai.model.gemma_layers`,
`astrai.model.sandwich`), never an if-branch in a forward.
"""

from __future__ import annotations

import dataclasses
from typing import Any

#: `ModelConfig.hidden_act`: the gate activation of the gated MLP (HF's names)
HIDDEN_ACTS = ("silu", "gelu_pytorch_tanh")
#: `ModelConfig.norm_type`: "rms" is x * w (Llama); "gemma" is x * (1 + w), weights start at 0
NORM_TYPES = ("rms", "gemma")


def attention_scale(config: Any) -> float:
    """The softmax scale of GQA attention: `query_pre_attn_scalar ** -0.5` where set (Gemma),
    else `head_dim ** -0.5`."""
    scalar = config.query_pre_attn_scalar
    return (scalar if scalar is not None else config.head_dim) ** -0.5


def local_rope_config(config: Any) -> Any:
    """`config` with the RoPE of sliding-window layers (`rope_local_base_freq`, no scaling),
    for the rotary table of those layers."""
    return dataclasses.replace(config, rope_theta=config.rope_local_base_freq, rope_scaling=None)


def gemma_problems(config: Any) -> list[str]:
    """What is wrong with the Gemma 3 fields of `config`, each message naming the field."""
    problems = []
    if config.hidden_act not in HIDDEN_ACTS:
        problems.append(
            f"ModelConfig.hidden_act: {config.hidden_act!r} is not one of {list(HIDDEN_ACTS)}"
        )
    elif config.hidden_act != "silu" and config.num_experts:
        problems.append(
            f"ModelConfig.hidden_act: {config.hidden_act!r} is for dense MLPs; experts use silu"
        )
    if config.norm_type not in NORM_TYPES:
        problems.append(
            f"ModelConfig.norm_type: {config.norm_type!r} is not one of {list(NORM_TYPES)}"
        )
    elif config.norm_type != "rms" and config.qk_norm and config.qk_norm_scope != "head":
        problems.append(
            f"ModelConfig.norm_type: {config.norm_type!r} q/k norms are per head "
            f"(qk_norm_scope='head'), got qk_norm_scope={config.qk_norm_scope!r}"
        )
    scalar = config.query_pre_attn_scalar
    if scalar is not None and scalar <= 0:
        problems.append(f"ModelConfig.query_pre_attn_scalar: must be positive, got {scalar}")
    local = config.rope_local_base_freq
    if local is not None and local <= 0:
        problems.append(f"ModelConfig.rope_local_base_freq: must be positive, got {local}")
    elif local is not None and config.sliding_window is None:
        problems.append(
            "ModelConfig.rope_local_base_freq: sets the RoPE of sliding-window layers; "
            "it needs sliding_window"
        )
    gemma = config.norm_type != "rms" or config.scale_embeddings or scalar is not None
    if config.attention_type == "mla" and (gemma or config.norm_position == "sandwich"):
        problems.append(
            "ModelConfig.attention_type: 'mla' takes no Gemma norm_type, scale_embeddings, "
            "query_pre_attn_scalar or sandwich blocks"
        )
    return problems
