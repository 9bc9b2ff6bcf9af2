"""Hugging Face translation of the mixture-of-experts families: Mixtral, Qwen2-MoE, Qwen3-MoE.

`hub.py` calls these for config translation (both ways) and weight names (both ways). HF
checkpoints store each expert's projections separately (`experts.<e>.w1/w2/w3` in Mixtral,
`experts.<e>.gate_proj/up_proj/down_proj` in Qwen), which is also what transformers 5's
`save_pretrained` writes although it holds them fused in memory; we stack them on import into
`experts.gate_up_proj [E, 2I, H]` / `experts.down_proj [E, H, I]` and unstack them on export.
Already-stacked tensors pass through, so our own directories load unchanged.
"""

from __future__ import annotations

import re
from typing import Any

import torch

from astrai.model.config import ConfigError, ModelConfig
from astrai.model.moe_config import expert_size, shared_size

MOE_ARCHITECTURES = {
    "mixtral": "MixtralForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
}
# Mixtral's per-expert names: w1 = gate, w3 = up, w2 = down.
_MIXTRAL_NAMES = {"gate": "w1", "up": "w3", "down": "w2"}
_QWEN_NAMES = {"gate": "gate_proj", "up": "up_proj", "down": "down_proj"}
_EXPERT_KEY = re.compile(
    r"^(?P<prefix>.*\.layers\.\d+)\.(?:mlp|block_sparse_moe)\.experts\.(?P<e>\d+)\."
    r"(?P<proj>w1|w2|w3|gate_proj|up_proj|down_proj)\.weight$"
)
_PROJ_ROLE = {"w1": "gate", "w3": "up", "w2": "down", **{v: k for k, v in _QWEN_NAMES.items()}}


# ---------------------------------------------------------------------- config
def config_fields(data: dict[str, Any], model_type: str | None, source: str) -> dict[str, Any]:
    """`ModelConfig` fields of an HF MoE `config.json` (and the attention flags that differ from
    the dense family's); {} for any other model_type."""
    if model_type not in MOE_ARCHITECTURES:
        return {}
    num_experts = data.get("num_local_experts", data.get("num_experts"))
    if not isinstance(num_experts, int) or num_experts <= 0:
        raise ConfigError(f"{source}: num_experts / num_local_experts must be a positive int")
    fields: dict[str, Any] = dict(
        num_experts=num_experts,
        num_experts_per_tok=data.get("num_experts_per_tok", 2),
        router_aux_loss_coef=float(data.get("router_aux_loss_coef", 0.001)),
    )
    if model_type == "mixtral":
        if data.get("router_jitter_noise"):
            raise ConfigError(f"{source}: router_jitter_noise is not supported")
        fields.update(norm_topk_prob=True, attention_bias=False, o_proj_bias=False)
        return fields
    fields.update(
        moe_intermediate_size=data.get("moe_intermediate_size"),
        norm_topk_prob=bool(data.get("norm_topk_prob", False)),
        mlp_only_layers=list(data.get("mlp_only_layers") or []),
        decoder_sparse_step=data.get("decoder_sparse_step", 1),
    )
    if model_type == "qwen2_moe":
        bias = bool(data.get("qkv_bias", True))
        fields.update(
            attention_bias=bias,
            o_proj_bias=False,
            num_shared_experts=1,
            shared_expert_intermediate_size=data.get("shared_expert_intermediate_size"),
            shared_expert_gate=True,
        )
    else:  # qwen3_moe
        bias = bool(data.get("attention_bias", False))
        fields.update(attention_bias=bias, o_proj_bias=bias, qk_norm=True)
    return fields


def _plain_routing(config: ModelConfig) -> bool:
    return (
        config.router_scoring == "softmax"
        and config.router_topk_method == "greedy"
        and config.routed_scaling_factor == 1.0
        and not config.router_correction_bias
    )


def hf_moe_model_type(config: ModelConfig) -> str:
    """The HF MoE architecture that computes `config` exactly, or a ConfigError saying why none."""
    if not _plain_routing(config):
        raise ConfigError(
            "this mixture of experts (sigmoid / grouped routing, scaling or correction bias) "
            "has no Mixtral / Qwen-MoE equivalent"
        )
    shared = config.num_shared_experts > 0
    all_sparse = all(config.is_moe_layer(i) for i in range(config.num_hidden_layers))
    candidates = []
    if (
        not shared
        and all_sparse
        and config.norm_topk_prob
        and not (config.qk_norm or config.attention_bias or config.o_proj_bias)
    ):
        candidates.append("mixtral")
    if shared and config.shared_expert_gate and not config.qk_norm and not config.o_proj_bias:
        candidates.append("qwen2_moe")
    if not shared and config.qk_norm and config.attention_bias == config.o_proj_bias:
        candidates.append("qwen3_moe")
    if not candidates:
        raise ConfigError(
            "no HF MoE architecture represents this model: Mixtral needs every layer sparse, "
            "norm_topk_prob and no shared expert or biases; Qwen2-MoE a gated shared expert; "
            "Qwen3-MoE qk_norm and no shared expert"
        )
    return config.hf_model_type if config.hf_model_type in candidates else candidates[0]


def _sparse_by_qwen(config: ModelConfig, layer_id: int) -> bool:
    """Dense layers Qwen cannot express by decoder_sparse_step go to mlp_only_layers."""
    step = (layer_id + 1) % config.decoder_sparse_step == 0
    return config.is_moe_layer(layer_id) or not step


def config_to_hf_fields(config: ModelConfig, model_type: str) -> dict[str, Any]:
    """The MoE entries of an HF `config.json` (they update the dense family's dict)."""
    if model_type not in MOE_ARCHITECTURES:
        return {}
    data: dict[str, Any] = {
        "architectures": [MOE_ARCHITECTURES[model_type]],
        "model_type": model_type,
        "num_experts_per_tok": config.num_experts_per_tok,
        "router_aux_loss_coef": config.router_aux_loss_coef,
        "output_router_logits": False,
    }
    if model_type == "mixtral":
        data.update(
            num_local_experts=config.num_experts,
            intermediate_size=expert_size(config),
            router_jitter_noise=0.0,
            sliding_window=None,
        )
        return data
    data.update(
        num_experts=config.num_experts,
        moe_intermediate_size=expert_size(config),
        norm_topk_prob=config.norm_topk_prob,
        mlp_only_layers=[
            i for i in range(config.num_hidden_layers) if not _sparse_by_qwen(config, i)
        ],
        decoder_sparse_step=config.decoder_sparse_step,
        use_sliding_window=False,
        sliding_window=None,
    )
    if model_type == "qwen2_moe":
        data.update(
            qkv_bias=config.attention_bias, shared_expert_intermediate_size=shared_size(config)
        )
    else:
        data["attention_bias"] = config.attention_bias
    return data


# ---------------------------------------------------------------------- weights
def state_from_hf(stored: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Stack per-expert HF tensors into our `experts.gate_up_proj` / `experts.down_proj` and
    rename Mixtral's `block_sparse_moe` to `mlp`; every other tensor passes through."""
    out: dict[str, torch.Tensor] = {}
    experts: dict[str, dict[str, dict[int, torch.Tensor]]] = {}
    for key, tensor in stored.items():
        match = _EXPERT_KEY.match(key)
        if match is None:
            out[key.replace(".block_sparse_moe.", ".mlp.")] = tensor
            continue
        layer = experts.setdefault(match["prefix"], {"gate": {}, "up": {}, "down": {}})
        layer[_PROJ_ROLE[match["proj"]]][int(match["e"])] = tensor
    for prefix, parts in experts.items():
        n = len(parts["down"])
        complete = all(sorted(p) == list(range(n)) for p in parts.values())
        if not complete:
            raise ValueError(f"{prefix}: experts' gate/up/down tensors are incomplete")
        gate = torch.stack([parts["gate"][e] for e in range(n)])
        up = torch.stack([parts["up"][e] for e in range(n)])
        out[f"{prefix}.mlp.experts.gate_up_proj"] = torch.cat([gate, up], dim=1)
        out[f"{prefix}.mlp.experts.down_proj"] = torch.stack([parts["down"][e] for e in range(n)])
    return out


def state_to_hf(state: dict[str, torch.Tensor], model_type: str) -> dict[str, torch.Tensor]:
    """Unstack our expert tensors into the per-expert names of `model_type`'s checkpoints."""
    if model_type not in MOE_ARCHITECTURES:
        return state
    names = _MIXTRAL_NAMES if model_type == "mixtral" else _QWEN_NAMES
    block = "block_sparse_moe" if model_type == "mixtral" else "mlp"
    out: dict[str, torch.Tensor] = {}
    for key, tensor in state.items():
        if key.endswith(".mlp.experts.gate_up_proj"):
            prefix = key[: -len(".mlp.experts.gate_up_proj")]
            gate, up = tensor.chunk(2, dim=1)
            for e in range(tensor.shape[0]):
                out[f"{prefix}.{block}.experts.{e}.{names['gate']}.weight"] = gate[e].contiguous()
                out[f"{prefix}.{block}.experts.{e}.{names['up']}.weight"] = up[e].contiguous()
        elif key.endswith(".mlp.experts.down_proj"):
            prefix = key[: -len(".mlp.experts.down_proj")]
            for e in range(tensor.shape[0]):
                out[f"{prefix}.{block}.experts.{e}.{names['down']}.weight"] = tensor[e].contiguous()
        elif model_type == "mixtral" and ".mlp.gate." in key:
            out[key.replace(".mlp.gate.", ".block_sparse_moe.gate.")] = tensor
        else:
            out[key] = tensor
    return out


__all__ = [
    "MOE_ARCHITECTURES",
    "config_fields",
    "config_to_hf_fields",
    "hf_moe_model_type",
    "state_from_hf",
    "state_to_hf",
]
