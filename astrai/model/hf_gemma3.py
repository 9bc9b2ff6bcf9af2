"""Hugging Face translation of Gemma 3's text model (`Gemma3ForCausalLM`, model_type
"gemma3_text"): sandwich blocks of (1 + w) RMSNorms, embeddings scaled by sqrt(hidden),
GeGLU (`hidden_activation`), `query_pre_attn_scalar`, and RoPE per layer type
(`rope_parameters["sliding_attention"]` -> `ModelConfig.rope_local_base_freq`).

The tensor names are ours already (`pre_feedforward_layernorm`, `self_attn.q_norm` per head),
so only the config translates. A vision-language checkpoint (model_type "gemma3",
`Gemma3ForConditionalGeneration`) loads as its text model: `text_config` is read, the
`language_model.` prefix is dropped from the weights and the vision tower and projector are
left out. Refused with a clear error: logit soft-capping (Gemma 2's), bidirectional attention,
and a sliding layers' RoPE with scaling. `hub.py` calls these.
"""

from __future__ import annotations

from typing import Any

import torch

from astrai.model.config import ConfigError, ModelConfig
from astrai.model.gemma_config import HIDDEN_ACTS

GEMMA3_ARCHITECTURES = {"gemma3_text": "Gemma3ForCausalLM"}
_LOCAL, _FULL = "sliding_attention", "full_attention"
# transformers' Gemma3TextConfig defaults, for the fields a config.json may leave out
_DEFAULTS = dict(
    vocab_size=262_208,
    hidden_size=2304,
    intermediate_size=9216,
    num_hidden_layers=26,
    num_attention_heads=8,
    num_key_value_heads=4,
    head_dim=256,
    max_position_embeddings=131_072,
    rms_norm_eps=1e-6,
    pad_token_id=0,
    eos_token_id=1,
    bos_token_id=2,
    tie_word_embeddings=True,
    query_pre_attn_scalar=256,
    sliding_window=4096,
)
# the vision-language checkpoint's text weights (transformers 5 writes the first spelling,
# 4.5x the second) and its vision-only tensors
_TEXT_PREFIXES = (
    ("language_model.model.", "model."),
    ("model.language_model.", "model."),
    ("language_model.lm_head.", "lm_head."),
)
_VISION_PREFIXES = (
    "vision_tower.",
    "multi_modal_projector.",
    "model.vision_tower.",
    "model.multi_modal_projector.",
)


def llama_view(data: dict[str, Any], source: str) -> dict[str, Any]:
    """A Gemma 3 text `config.json` as the Llama translation reads it: HF's defaults filled
    in, `rope_parameters` = the full-attention layers' RoPE, and the sliding layers' base under
    its legacy name `rope_local_base_freq`; a vision-language "gemma3" config is read as its
    `text_config`; any other model_type passes unchanged."""
    model_type = data.get("model_type")
    if model_type == "gemma3":
        data = _text_config(data, source)
        model_type = data["model_type"]
    if model_type not in GEMMA3_ARCHITECTURES:
        return data
    full, local = _rope_by_type(data, source)
    return {
        **_DEFAULTS,
        **data,
        "rope_parameters": full,
        "rope_scaling": None,
        "rope_local_base_freq": local["rope_theta"],
    }


def _text_config(data: dict[str, Any], source: str) -> dict[str, Any]:
    """The text model's config of a `Gemma3ForConditionalGeneration` config (whose own
    `tie_word_embeddings` ties its head)."""
    text = data.get("text_config")
    if not isinstance(text, dict):
        raise ConfigError(
            f"{source}: text_config: a model_type 'gemma3' (vision-language) config needs its "
            f"text model's config here, got {text!r}"
        )
    tie = data.get("tie_word_embeddings", text.get("tie_word_embeddings", True))
    return {**text, "model_type": "gemma3_text", "tie_word_embeddings": tie}


def state_from_hf(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A vision-language Gemma 3 checkpoint's text weights under the text model's names
    (`language_model.` dropped; vision tower and projector left out); others pass."""
    if not any(k.startswith(("language_model.", "model.language_model.")) for k in state):
        return state
    out = {}
    for key, tensor in state.items():
        if key.startswith(_VISION_PREFIXES):
            continue
        for old, new in _TEXT_PREFIXES:
            if key.startswith(old):
                key = new + key.removeprefix(old)
                break
        out[key] = tensor
    return out


def _rope_by_type(data: dict[str, Any], source: str) -> tuple[dict, dict]:
    """(full, sliding) RoPE parameters, from transformers 5's per-type `rope_parameters` or
    the older `rope_theta` / `rope_scaling` / `rope_local_base_freq` (as transformers reads them)."""
    params = data.get("rope_parameters") or {}
    if params and not all(isinstance(params.get(t), dict) for t in (_LOCAL, _FULL)):
        raise ConfigError(
            f"{source}: rope_parameters: Gemma 3 expects one entry per layer type "
            f"({_FULL!r} and {_LOCAL!r}), got {sorted(params)}"
        )
    full = dict(params.get(_FULL) or {"rope_type": "default"})
    full.update(data.get("rope_scaling") or {})
    full.setdefault("rope_theta", data.get("rope_theta", 1_000_000.0))
    local = dict(params.get(_LOCAL) or {"rope_type": "default"})
    local.setdefault("rope_theta", data.get("rope_local_base_freq", 10_000.0))
    if local.get("rope_type", local.get("type", "default")) != "default":
        raise ConfigError(
            f"{source}: rope_parameters.{_LOCAL}: RoPE scaling on sliding-window layers "
            f"({local.get('rope_type', local.get('type'))!r}) is not supported"
        )
    return full, local


def config_fields(data: dict[str, Any], model_type: str | None, source: str) -> dict[str, Any]:
    """The `ModelConfig` fields in which a Gemma 3 text config (seen through `llama_view`)
    differs from Llama's; {} for any other model_type. Refuses what astrai cannot compute."""
    if model_type not in GEMMA3_ARCHITECTURES:
        return {}
    for name in ("attn_logit_softcapping", "final_logit_softcapping"):
        if data.get(name) is not None:
            raise ConfigError(
                f"{source}: {name}={data[name]!r} is not supported (Gemma 3 has none; "
                "soft-capping is Gemma 2's)"
            )
    if data.get("use_bidirectional_attention"):
        raise ConfigError(f"{source}: use_bidirectional_attention=true is not supported")
    act = data.get("hidden_activation") or data.get("hidden_act") or "gelu_pytorch_tanh"
    if act not in HIDDEN_ACTS:
        raise ConfigError(f"{source}: hidden_activation={act!r} is not one of {list(HIDDEN_ACTS)}")
    fields = dict(
        qk_norm=True,
        norm_position="sandwich",
        norm_type="gemma",
        scale_embeddings=True,
        hidden_act=act,
        query_pre_attn_scalar=data["query_pre_attn_scalar"],
    )
    return fields | _window_fields(data)


def _window_fields(data: dict[str, Any]) -> dict[str, Any]:
    """`sliding_window`, `layer_types` and the sliding layers' RoPE base, as transformers
    reads them (`layer_types` default: every `sliding_window_pattern`-th layer is full)."""
    n = data["num_hidden_layers"]
    pattern = data.get("sliding_window_pattern", data.get("_sliding_window_pattern", 6))
    types = data.get("layer_types") or [_LOCAL if (i + 1) % pattern else _FULL for i in range(n)]
    if data.get("sliding_window") is None or _LOCAL not in types:
        return {}
    return dict(
        sliding_window=data["sliding_window"],
        layer_types=list(types),
        rope_local_base_freq=float(data["rope_local_base_freq"]),
    )


def is_gemma3(config: ModelConfig) -> bool:
    """Whether `config` uses one of Gemma 3's variants (only Gemma 3 can represent it)."""
    return (
        config.norm_position == "sandwich"
        or config.norm_type == "gemma"
        or config.scale_embeddings
        or config.hidden_act != "silu"
        or config.query_pre_attn_scalar is not None
        or config.rope_local_base_freq is not None
    )


def hf_gemma3_model_type(config: ModelConfig) -> str:
    """'gemma3_text' when Gemma 3 computes `config` exactly, else a ConfigError saying why not."""
    exact = (
        config.norm_position == "sandwich"
        and config.norm_type == "gemma"
        and config.scale_embeddings
        and config.qk_norm
        and config.qk_norm_scope == "head"
        and config.hidden_act == "gelu_pytorch_tanh"
    )
    if not exact:
        raise ConfigError(
            "Gemma 3's variants (norm_position='sandwich', norm_type='gemma', "
            "scale_embeddings, hidden_act='gelu_pytorch_tanh', query_pre_attn_scalar, "
            "rope_local_base_freq) export only as Gemma 3, which needs the first four together "
            "with qk_norm=true (per head)"
        )
    if config.attention_bias != config.o_proj_bias or config.partial_rotary_factor != 1:
        raise ConfigError(
            "Gemma 3 has no attention_bias != o_proj_bias and no partial_rotary_factor"
        )
    if config.num_experts:
        raise ConfigError("Gemma 3 has no mixture of experts (num_experts must be 0)")
    return "gemma3_text"


def config_to_hf_fields(config: ModelConfig, model_type: str) -> dict[str, Any]:
    """Gemma 3's own `config.json` fields; {} for any other model_type."""
    if model_type not in GEMMA3_ARCHITECTURES:
        return {}
    full = {"rope_type": "default", "rope_theta": config.rope_theta}
    full.update(config.rope_scaling or {})
    local = dict(full)  # no local base: the sliding layers rotate as the full ones
    if config.rope_local_base_freq is not None:
        local = {"rope_type": "default", "rope_theta": config.rope_local_base_freq}
    n = config.num_hidden_layers
    types = [_LOCAL if config.layer_window(i) is not None else _FULL for i in range(n)]
    scalar = config.query_pre_attn_scalar or config.head_dim
    return {
        "hidden_activation": config.hidden_act,
        "hidden_act": config.hidden_act,
        "query_pre_attn_scalar": int(scalar) if float(scalar).is_integer() else scalar,
        # transformers builds a sliding mask even when no layer uses it: any window will do
        "sliding_window": config.sliding_window or config.max_position_embeddings,
        "layer_types": types,
        "rope_parameters": {_FULL: full, _LOCAL: local},
        "rope_scaling": None,
        "attention_bias": config.attention_bias,
        "attn_logit_softcapping": None,
        "final_logit_softcapping": None,
        "use_bidirectional_attention": False,
    }
