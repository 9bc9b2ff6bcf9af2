"""The multi-head latent attention (MLA) part of `ModelConfig`: defaults and validation.

Kept apart from config.py so that the dense fields stay readable; these functions take the
config object and touch only the MLA fields (and `head_dim`, which MLA fixes to the rotary
dimension so that the shared RoPE table and YaRN code serve the decoupled rotary key).
"""

from __future__ import annotations

import math
from typing import Any

ATTENTION_TYPES = ("gqa", "mla")
_MLA_REQUIRED = ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")


def mla_head_dim(config: Any) -> int | None:
    """`head_dim` after defaults: MLA rotates only `qk_rope_head_dim` dims, so that is its RoPE dim."""
    if config.attention_type == "mla" and config.head_dim is None:
        return config.qk_rope_head_dim
    return config.head_dim


def mla_problems(config: Any) -> list[str]:
    """What is wrong with the MLA fields, each message naming the field (empty when fine)."""
    if config.attention_type not in ATTENTION_TYPES:
        return [
            f"ModelConfig.attention_type: {config.attention_type!r} is not one of "
            f"{list(ATTENTION_TYPES)}"
        ]
    if config.attention_type != "mla":
        return []
    for name in _MLA_REQUIRED:
        if getattr(config, name) is None:
            return [f"ModelConfig.{name}: required when attention_type is 'mla'"]
    for name in ("q_lora_rank", *_MLA_REQUIRED):
        value = getattr(config, name)
        if value is not None and value <= 0:
            return [f"ModelConfig.{name}: must be positive, got {value}"]
    if config.qk_rope_head_dim % 2:
        return [
            f"ModelConfig.qk_rope_head_dim: must be even for RoPE, got {config.qk_rope_head_dim}"
        ]
    if config.head_dim != config.qk_rope_head_dim:
        return [
            f"ModelConfig.head_dim: must equal qk_rope_head_dim ({config.qk_rope_head_dim}) "
            f"for MLA (it is the rotary dimension), got {config.head_dim}"
        ]
    if config.qk_norm:
        return ["ModelConfig.qk_norm: not supported with attention_type 'mla'"]
    return []


def mla_softmax_scale(config: Any) -> float:
    """DeepSeek's softmax scale: `qk_head_dim ** -0.5`, times mscale(factor, mscale_all_dim)^2
    under YaRN (the rotary table carries mscale / mscale_all_dim on its own)."""
    scale = (config.qk_nope_head_dim + config.qk_rope_head_dim) ** -0.5
    rope = config.rope_scaling or {}
    if rope.get("rope_type", "default") != "default" and rope.get("mscale_all_dim"):
        factor = rope["factor"]
        m = 1.0 if factor <= 1 else 0.1 * rope["mscale_all_dim"] * math.log(factor) + 1.0
        scale *= m * m
    return scale


def kv_bytes_per_token(config: Any, element_size: int) -> int:
    """KV cache bytes one token takes over all layers: MLA stores the normed latent plus the
    rotary key (one vector per layer), GQA a K and a V per kv head."""
    if config.attention_type == "mla":
        width = config.kv_lora_rank + config.qk_rope_head_dim
        return config.num_hidden_layers * width * element_size
    width = 2 * config.num_key_value_heads * config.head_dim
    return config.num_hidden_layers * width * element_size


def kv_geometry(config: Any) -> dict[str, int]:
    """`PagePool` keywords for the per-layer KV layout of `config` (latent for MLA)."""
    if config.attention_type == "mla":
        return {"num_kv_heads": 1, "head_dim": 1, "latent_dim": mla_latent_dim(config)}
    return {"num_kv_heads": config.num_key_value_heads, "head_dim": config.head_dim}


def mla_latent_dim(config: Any) -> int:
    """Width of an MLA cache entry: the KV latent plus the rotary key."""
    return config.kv_lora_rank + config.qk_rope_head_dim


def mla_attention_params(config: Any) -> int:
    """Parameters of one MLA attention module, from the shapes alone."""
    h, heads, bias = config.hidden_size, config.num_attention_heads, config.attention_bias
    qk = config.qk_nope_head_dim + config.qk_rope_head_dim
    width = mla_latent_dim(config)
    if config.q_lora_rank is None:
        n = h * heads * qk
    else:
        rank = config.q_lora_rank
        n = h * rank + rank * bias + rank + rank * heads * qk
    n += h * width + width * bias + config.kv_lora_rank
    n += config.kv_lora_rank * heads * (config.qk_nope_head_dim + config.v_head_dim)
    return n + heads * config.v_head_dim * h + h * config.o_proj_bias
