"""Hugging Face translation of Phi-3 / Phi-4 (`Phi3ForCausalLM`; Phi-4 and Phi-4-mini use
this architecture): fused `qkv_proj` / `gate_up_proj` and `partial_rotary_factor`.

The fused projections are split on import into our `q_proj`/`k_proj`/`v_proj` and
`gate_proj`/`up_proj` (the same rows, so an engine packs them back for inference) and fused
again on export. LongRoPE (`rope_type: "longrope"`: Phi-3-*-128k, Phi-3.5, Phi-4-mini) keeps
its factors in `rope_scaling` with `original_max_position_embeddings` (astrai/model/longrope.py
computes it). A `sliding_window` shorter than `max_position_embeddings`
(Phi-3-mini-4k: 2047) is one window on every layer, as transformers applies it; one at least
that long is no window. `hub.py` calls these.
"""

from __future__ import annotations

import re
from typing import Any

import torch

from astrai.model.config import ConfigError, ModelConfig

PHI3_ARCHITECTURES = {"phi3": "Phi3ForCausalLM"}
_FUSED_QKV = re.compile(r"^(?P<prefix>.*\.self_attn)\.qkv_proj\.weight$")
_FUSED_GATE_UP = re.compile(r"^(?P<prefix>.*\.mlp)\.gate_up_proj\.weight$")


def config_fields(data: dict[str, Any], model_type: str | None, source: str) -> dict[str, Any]:
    """The `ModelConfig` fields of a Phi-3 `config.json` beyond Llama's; {} for any other
    model_type. Refuses what astrai cannot compute exactly (naming the field)."""
    if model_type not in PHI3_ARCHITECTURES:
        return {}
    rope = dict(data.get("rope_parameters") or {})
    scaling = dict(data.get("rope_scaling") or rope)
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind in ("su", "yarn"):  # Phi-3's early names for LongRoPE, as transformers reads them
        kind = "longrope"
    if kind not in ("default", "longrope"):
        raise ConfigError(f"{source}: rope_scaling of type {kind!r} is not supported for Phi-3")
    longrope = {}
    if kind == "longrope":
        keep = ("short_factor", "long_factor", "factor", "attention_factor")
        longrope = {k: scaling[k] for k in keep if scaling.get(k) is not None}
        original = scaling.get("original_max_position_embeddings")
        original = original or data.get("original_max_position_embeddings")
        if original is None:
            raise ConfigError(f"{source}: longrope needs original_max_position_embeddings")
        longrope = dict(rope_type="longrope", original_max_position_embeddings=original, **longrope)
    window = data.get("sliding_window")
    limit = data.get("max_position_embeddings", 4096)
    windowed = {"sliding_window": window} if window is not None and window < limit else {}
    partial = rope.get("partial_rotary_factor", data.get("partial_rotary_factor", 1.0))
    fields = dict(partial_rotary_factor=float(partial), attention_bias=False, o_proj_bias=False)
    fields["rope_scaling"] = longrope or None
    return fields | windowed  # one window on every layer, as transformers' Phi-3 applies it


def hf_phi3_model_type(config: ModelConfig) -> str | None:
    """'phi3' when `config` needs Phi-3 (partial rotary) or came from it and Phi-3 computes it
    exactly; None when another family should represent it; a ConfigError when none can."""
    plain = not (config.qk_norm or config.attention_bias or config.o_proj_bias)
    plain = plain and config.layer_types is None  # Phi-3's window covers every layer
    longrope = (config.rope_scaling or {}).get("rope_type") == "longrope"
    if config.partial_rotary_factor != 1 or longrope:
        if not plain or config.num_experts:
            raise ConfigError(
                "partial_rotary_factor and longrope export only as Phi-3, which has no qk_norm, "
                "biases, experts or per-layer windows (layer_types)"
            )
        return "phi3"
    if config.hf_model_type == "phi3" and plain and not config.num_experts:
        return "phi3"
    return None


def config_to_hf_fields(config: ModelConfig, model_type: str) -> dict[str, Any]:
    """Phi-3's own `config.json` fields; {} for any other model_type."""
    if model_type not in PHI3_ARCHITECTURES:
        return {}
    scaling = dict(config.rope_scaling or {"rope_type": "default"})
    original = scaling.get("original_max_position_embeddings", config.max_position_embeddings)
    rope = scaling | {
        "rope_theta": config.rope_theta,
        "partial_rotary_factor": config.partial_rotary_factor,
    }
    return {
        "partial_rotary_factor": config.partial_rotary_factor,
        "rope_parameters": rope,
        "rope_scaling": None,
        "original_max_position_embeddings": original,
        "sliding_window": config.sliding_window,
        "resid_pdrop": 0.0,
        "embd_pdrop": 0.0,
    }


def state_from_hf(state: dict[str, torch.Tensor], config: ModelConfig) -> dict[str, torch.Tensor]:
    """Split Phi-3's fused `qkv_proj` / `gate_up_proj` into our projections (others pass)."""
    q = config.num_attention_heads * config.head_dim
    kv = config.num_key_value_heads * config.head_dim
    out: dict[str, torch.Tensor] = {}
    for key, tensor in state.items():
        if m := _FUSED_QKV.match(key):
            for name, part in zip(("q_proj", "k_proj", "v_proj"), tensor.split([q, kv, kv])):
                out[f"{m['prefix']}.{name}.weight"] = part
        elif m := _FUSED_GATE_UP.match(key):
            gate, up = tensor.chunk(2, dim=0)
            out[f"{m['prefix']}.gate_proj.weight"] = gate
            out[f"{m['prefix']}.up_proj.weight"] = up
        else:
            out[key] = tensor
    return out


def state_to_hf(state: dict[str, torch.Tensor], model_type: str) -> dict[str, torch.Tensor]:
    """Fuse our projections into Phi-3's `qkv_proj` / `gate_up_proj` (for model_type 'phi3')."""
    if model_type not in PHI3_ARCHITECTURES:
        return state
    out = dict(state)
    for key in [k for k in state if k.endswith(".self_attn.q_proj.weight")]:
        prefix = key.removesuffix(".q_proj.weight")
        parts = [out.pop(f"{prefix}.{n}_proj.weight") for n in ("q", "k", "v")]
        out[f"{prefix}.qkv_proj.weight"] = torch.cat(parts).contiguous()
    for key in [k for k in state if k.endswith(".mlp.gate_proj.weight")]:
        prefix = key.removesuffix(".gate_proj.weight")
        parts = [out.pop(f"{prefix}.{n}_proj.weight") for n in ("gate", "up")]
        out[f"{prefix}.gate_up_proj.weight"] = torch.cat(parts).contiguous()
    return out
