"""Hugging Face translation of GPT-OSS (`GptOssForCausalLM`, model_type "gpt_oss").

GPT-OSS is a mixture of experts on every layer with attention sinks, biased router and
experts, a clamped SwiGLU (`swiglu_limit`), YaRN RoPE (`truncate: false`) and alternating
sliding-window / full layers. `ModelConfig` says each of these with its own field (the
"GPT-OSS" block), so the rest of astrai (training, LoRA, the engine) serves it as any family.

Weights: HF keeps each layer's experts stacked and transposed, `gate_up_proj [E, H, 2I]` with
gate and up *interleaved* (gate = columns 0, 2, 4, ..., up = 1, 3, 5, ...) and `down_proj [E,
I, H]`; astrai's `Experts` hold `gate_up_proj [E, 2I, H]` (gate rows first) and `down_proj
[E, H, I]`. The router is `mlp.router` there, `mlp.gate` here. Both directories astrai writes
for a GPT-OSS model store HF's layout (`hub` keeps HF's tensor names and layouts on disk).
Checkpoints quantised to MXFP4 (the official ones) are dequantised on load by `hf_mxfp4`.
"""

from __future__ import annotations

from typing import Any

import torch

from astrai.model.config import ConfigError, ModelConfig
from astrai.model.moe_config import expert_size

GPT_OSS_ARCHITECTURES = {"gpt_oss": "GptOssForCausalLM"}
_EXPERTS = ".mlp.experts."
_ROUTER_HF, _ROUTER = ".mlp.router.", ".mlp.gate."


# ---------------------------------------------------------------------- config
def config_fields(data: dict[str, Any], model_type: str | None, source: str) -> dict[str, Any]:
    """The `ModelConfig` fields of a GPT-OSS `config.json` beyond the dense family's; {} for
    any other model_type."""
    if model_type not in GPT_OSS_ARCHITECTURES:
        return {}
    quant = (data.get("quantization_config") or {}).get("quant_method")
    if quant not in (None, "mxfp4"):
        raise ConfigError(
            f"{source}: quantization_config.quant_method={quant!r} is not supported for "
            "gpt_oss (MXFP4 and unquantised checkpoints load)"
        )
    num_experts = data.get("num_local_experts", data.get("num_experts"))
    if not isinstance(num_experts, int) or num_experts <= 0:
        raise ConfigError(f"{source}: num_local_experts must be a positive int")
    layers = data.get("num_hidden_layers") or 0
    types = data.get("layer_types") or [
        "sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(layers)
    ]
    window = data.get("sliding_window")
    windows: dict[str, Any] = {}
    if window is not None and "sliding_attention" in types:
        windows = {"sliding_window": window, "layer_types": list(types)}
    bias = bool(data.get("attention_bias", True))
    return dict(
        num_experts=num_experts,
        num_experts_per_tok=data.get("num_experts_per_tok", 4),
        norm_topk_prob=True,  # softmax over the top-k logits = renormalised top-k softmax
        router_aux_loss_coef=float(data.get("router_aux_loss_coef", 0.001)),
        attention_bias=bias,
        o_proj_bias=bias,
        attention_sinks=True,
        router_bias=True,
        expert_bias=True,
        swiglu_limit=float(data.get("swiglu_limit", 7.0)),
        swiglu_alpha=float(data.get("swiglu_alpha", 1.702)),
        **windows,
    )


def is_gpt_oss(config: ModelConfig) -> bool:
    """Whether `config` uses a GPT-OSS feature (then only GPT-OSS can export it)."""
    return (
        config.attention_sinks
        or config.router_bias
        or config.expert_bias
        or config.swiglu_limit is not None
    )


def hf_gpt_oss_model_type(config: ModelConfig) -> str:
    """'gpt_oss' when GPT-OSS computes `config` exactly, else a ConfigError saying why not."""
    problems = []
    if not (config.attention_sinks and config.router_bias and config.expert_bias):
        problems.append("attention_sinks, router_bias and expert_bias all set")
    if config.swiglu_limit is None:
        problems.append("swiglu_limit set")
    if not all(config.is_moe_layer(i) for i in range(config.num_hidden_layers)):
        problems.append("every layer sparse")
    plain_routing = (
        config.router_scoring == "softmax"
        and config.router_topk_method == "greedy"
        and config.routed_scaling_factor == 1.0
        and not config.router_correction_bias
        and config.norm_topk_prob
    )
    if not plain_routing or config.num_shared_experts:
        problems.append("softmax top-k routing with norm_topk_prob and no shared expert")
    if config.attention_bias != config.o_proj_bias or config.qk_norm:
        problems.append("attention_bias == o_proj_bias and no qk_norm")
    if config.norm_position != "pre" or config.partial_rotary_factor != 1:
        problems.append("pre-norm blocks and full rotary")
    if problems:
        raise ConfigError("GPT-OSS export needs " + "; ".join(problems))
    return "gpt_oss"


def config_to_hf_fields(config: ModelConfig, model_type: str) -> dict[str, Any]:
    """The GPT-OSS entries of an HF `config.json` (they update the dense family's dict)."""
    if model_type not in GPT_OSS_ARCHITECTURES:
        return {}
    window = config.sliding_window
    if window is None:  # transformers would alternate windows when layer_types is absent
        types = ["full_attention"] * config.num_hidden_layers
    else:
        types = config.layer_types or ["sliding_attention"] * config.num_hidden_layers
    return {
        "num_local_experts": config.num_experts,
        "num_experts_per_tok": config.num_experts_per_tok,
        "intermediate_size": expert_size(config),
        "router_aux_loss_coef": config.router_aux_loss_coef,
        "output_router_logits": False,
        "attention_bias": config.attention_bias,
        "swiglu_limit": config.swiglu_limit,
        "swiglu_alpha": config.swiglu_alpha,
        "sliding_window": window if window is not None else config.max_position_embeddings,
        "layer_types": list(types),
        "head_dim": config.head_dim,
    }


# ---------------------------------------------------------------------- weights
def gate_up_from_hf(weight: torch.Tensor, bias: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """HF's interleaved `[E, H, 2I]` / `[E, 2I]` as astrai's `[E, 2I, H]` / `[E, 2I]`."""
    w = torch.cat([weight[..., ::2], weight[..., 1::2]], dim=-1).transpose(1, 2)
    return w.contiguous(), torch.cat([bias[..., ::2], bias[..., 1::2]], dim=-1)


def gate_up_to_hf(weight: torch.Tensor, bias: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """astrai's `[E, 2I, H]` / `[E, 2I]` as HF's interleaved `[E, H, 2I]` / `[E, 2I]`."""

    def interleave(t: torch.Tensor) -> torch.Tensor:
        gate, up = t.chunk(2, dim=-1)
        return torch.stack([gate, up], dim=-1).flatten(-2)

    return interleave(weight.transpose(1, 2)).contiguous(), interleave(bias).contiguous()


def state_from_hf(stored: dict[str, torch.Tensor], config: ModelConfig) -> dict[str, torch.Tensor]:
    """HF GPT-OSS tensors in astrai's layout (expert tensors re-laid, router renamed); the
    state of any other model passes through."""
    if not is_gpt_oss(config):
        return stored
    out: dict[str, torch.Tensor] = {}
    for key, tensor in stored.items():
        if key.endswith(_EXPERTS + "gate_up_proj"):
            bias = stored[key + "_bias"]
            out[key], out[key + "_bias"] = gate_up_from_hf(tensor, bias)
        elif key.endswith(_EXPERTS + "down_proj"):
            out[key] = tensor.transpose(1, 2).contiguous()
        elif not key.endswith(_EXPERTS + "gate_up_proj_bias"):
            out[key.replace(_ROUTER_HF, _ROUTER)] = tensor
    return out


def state_to_hf(state: dict[str, torch.Tensor], config: ModelConfig) -> dict[str, torch.Tensor]:
    """astrai's GPT-OSS tensors in HF's layout and names (inverse of `state_from_hf`)."""
    if not is_gpt_oss(config):
        return state
    out: dict[str, torch.Tensor] = {}
    for key, tensor in state.items():
        if key.endswith(_EXPERTS + "gate_up_proj"):
            out[key], out[key + "_bias"] = gate_up_to_hf(tensor, state[key + "_bias"])
        elif key.endswith(_EXPERTS + "down_proj"):
            out[key] = tensor.transpose(1, 2).contiguous()
        elif not key.endswith(_EXPERTS + "gate_up_proj_bias"):
            out[key.replace(_ROUTER, _ROUTER_HF)] = tensor
    return out


__all__ = [
    "GPT_OSS_ARCHITECTURES",
    "config_fields",
    "config_to_hf_fields",
    "gate_up_from_hf",
    "gate_up_to_hf",
    "hf_gpt_oss_model_type",
    "is_gpt_oss",
    "state_from_hf",
    "state_to_hf",
]
