"""Hugging Face translation of DeepSeek-V2 / V3 (`DeepseekV2ForCausalLM`, `DeepseekV3ForCausalLM`).

`hub.py` calls these for config translation (both ways) and weight layout (both ways).
Attention is multi-head latent attention (astrai/model/mla.py, same parameter names); the
MLP of layers `>= first_k_dense_replace` is the mixture of experts of astrai/model/moe.py:
V2 routes with softmax (greedy or group-limited greedy), V3 with sigmoid plus the correction
bias and the grouped `noaux_tc` top-k. Both scale routed weights by `routed_scaling_factor`
and add `n_shared_experts` shared experts (one fused MLP).

DeepSeek lays the rotary part of q and k out in interleaved pairs; our RoPE is half-split, so
the rotary rows of `q_proj`/`q_b_proj` and of `kv_a_proj_with_mqa` are de-interleaved on load
and re-interleaved on save. MLA weights are always stored interleaved (our own directories
included), so a directory's tensors never depend on its config flavour.
"""

from __future__ import annotations

import logging
import re
from typing import Any

import torch

from astrai.model import hf_moe
from astrai.model.config import ConfigError, ModelConfig
from astrai.model.hf_common import hf_base_fields
from astrai.model.moe_config import expert_size

logger = logging.getLogger(__name__)

DEEPSEEK_ARCHITECTURES = {
    "deepseek_v2": "DeepseekV2ForCausalLM",
    "deepseek_v3": "DeepseekV3ForCausalLM",
}
_LAYER = re.compile(r"(^|\.)layers\.(\d+)\.")


# ---------------------------------------------------------------------- config
def _rope_scaling(data: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    params = dict(data.get("rope_parameters") or {})
    theta = params.pop("rope_theta", None) or data.get("rope_theta") or 10000.0
    scaling = data.get("rope_scaling") or params or None
    if scaling is not None:
        scaling = dict(scaling)
        scaling.pop("rope_theta", None)
        kind = scaling.pop("type", None) or scaling.get("rope_type") or "default"
        scaling["rope_type"] = kind
        if kind == "default":
            scaling = None
    return float(theta), scaling


def config_from_hf(data: dict[str, Any], *, source: str) -> ModelConfig:
    """Translate a DeepSeek-V2 / V3 `config.json` dict."""
    model_type = data["model_type"]
    if data.get("mlp_bias"):
        raise ConfigError(f"{source}: mlp_bias=true is not supported")
    if model_type == "deepseek_v3" and data.get("rope_interleave", True) is False:
        raise ConfigError(f"{source}: rope_interleave=false is not supported")
    if data.get("moe_layer_freq", 1) != 1:
        raise ConfigError(f"{source}: moe_layer_freq={data['moe_layer_freq']} is not supported")
    theta, scaling = _rope_scaling(data)
    layers = data.get("num_hidden_layers")
    first_dense = data.get("first_k_dense_replace") or 0
    experts = data.get("n_routed_experts") or 0
    bias = bool(data.get("attention_bias", False))
    fields: dict[str, Any] = dict(
        vocab_size=data.get("vocab_size"),
        hidden_size=data.get("hidden_size"),
        intermediate_size=data.get("intermediate_size"),
        num_hidden_layers=layers,
        num_attention_heads=data.get("num_attention_heads"),
        rms_norm_eps=data.get("rms_norm_eps", 1e-6),
        rope_theta=theta,
        rope_scaling=scaling,
        max_position_embeddings=data.get("max_position_embeddings", 4096),
        tie_word_embeddings=bool(data.get("tie_word_embeddings", False)),
        attention_bias=bias,
        o_proj_bias=bias,
        initializer_range=data.get("initializer_range", 0.02),
        bos_token_id=data.get("bos_token_id"),
        eos_token_id=data.get("eos_token_id"),
        pad_token_id=data.get("pad_token_id"),
        hf_model_type=model_type,
        attention_type="mla",
        q_lora_rank=data.get("q_lora_rank"),
        kv_lora_rank=data.get("kv_lora_rank"),
        qk_nope_head_dim=data.get("qk_nope_head_dim"),
        qk_rope_head_dim=data.get("qk_rope_head_dim"),
        v_head_dim=data.get("v_head_dim"),
    )
    missing = [k for k in ("vocab_size", "hidden_size", "num_hidden_layers") if fields[k] is None]
    if missing:
        raise ConfigError(f"{source}: missing required field(s) {missing}")
    if experts and isinstance(layers, int) and first_dense < layers:
        shared = data.get("n_shared_experts") or 0
        fields.update(
            num_experts=experts,
            num_experts_per_tok=data.get("num_experts_per_tok"),
            moe_intermediate_size=data.get("moe_intermediate_size"),
            num_shared_experts=shared,
            first_k_dense_replace=first_dense,
            routed_scaling_factor=float(data.get("routed_scaling_factor", 1.0)),
            router_aux_loss_coef=float(data.get("aux_loss_alpha", 0.001)),
        )
        if model_type == "deepseek_v3":
            fields.update(
                router_scoring="sigmoid",
                router_topk_method="noaux_tc",
                router_correction_bias=True,
                n_group=data.get("n_group") or 1,
                topk_group=data.get("topk_group") or 1,
                norm_topk_prob=bool(data.get("norm_topk_prob", True)),
            )
        else:
            method = data.get("topk_method") or "greedy"
            if method not in ("greedy", "group_limited_greedy"):
                raise ConfigError(f"{source}: topk_method={method!r} is not supported for V2")
            if data.get("norm_topk_prob"):
                # transformers' DeepseekV2 router never renormalises; we match it.
                logger.warning("%s: norm_topk_prob is ignored, as transformers does", source)
            fields.update(
                router_scoring="softmax",
                router_topk_method=method,
                n_group=data.get("n_group") or 1,
                topk_group=data.get("topk_group") or 1,
            )
    return ModelConfig.from_dict({k: v for k, v in fields.items() if v is not None}, source=source)


def hf_deepseek_model_type(config: ModelConfig) -> str:
    """`deepseek_v2` or `deepseek_v3` for an MLA model, or a ConfigError saying why neither fits."""
    if config.qk_norm or config.attention_bias != config.o_proj_bias:
        raise ConfigError("DeepSeek has no qk_norm and one attention_bias for all projections")
    if not config.num_experts:
        return (
            config.hf_model_type
            if config.hf_model_type in DEEPSEEK_ARCHITECTURES
            else "deepseek_v3"
        )
    if config.mlp_only_layers or config.decoder_sparse_step != 1 or config.shared_expert_gate:
        raise ConfigError("DeepSeek MoE has no mlp_only_layers / decoder_sparse_step / shared gate")
    if config.num_shared_experts and config.shared_expert_intermediate_size not in (
        None,
        expert_size(config) * config.num_shared_experts,
    ):
        raise ConfigError("DeepSeek's shared experts are n_shared_experts * moe_intermediate_size")
    v3 = (
        config.router_scoring == "sigmoid"
        and config.router_topk_method == "noaux_tc"
        and config.router_correction_bias
    )
    v2 = (
        config.router_scoring == "softmax"
        and config.router_topk_method in ("greedy", "group_limited_greedy")
        and not config.router_correction_bias
        and not config.norm_topk_prob
    )
    if v3:
        return "deepseek_v3"
    if v2:
        return "deepseek_v2"
    raise ConfigError(
        "this MLA mixture of experts matches neither DeepSeek-V3 (sigmoid, noaux_tc, correction "
        "bias) nor DeepSeek-V2 (softmax, greedy / group_limited_greedy, no norm_topk_prob)"
    )


def config_to_hf(config: ModelConfig, dtype: torch.dtype = torch.float32) -> dict[str, Any]:
    """The `config.json` dict of the DeepSeek architecture that computes `config`."""
    model_type = hf_deepseek_model_type(config)
    layers = config.num_hidden_layers
    data = hf_base_fields(config, DEEPSEEK_ARCHITECTURES[model_type], model_type, dtype)
    data.update(
        num_key_value_heads=config.num_attention_heads,
        q_lora_rank=config.q_lora_rank,
        kv_lora_rank=config.kv_lora_rank,
        qk_nope_head_dim=config.qk_nope_head_dim,
        qk_rope_head_dim=config.qk_rope_head_dim,
        v_head_dim=config.v_head_dim,
        attention_bias=config.attention_bias,
    )
    if model_type == "deepseek_v3":
        data["rope_interleave"] = True
        data["num_nextn_predict_layers"] = 0
    if not config.num_experts:  # every layer dense
        data.update(first_k_dense_replace=layers, n_routed_experts=1, n_shared_experts=1)
        data.update(num_experts_per_tok=1, moe_intermediate_size=config.intermediate_size)
        data.update(n_group=1, topk_group=1)
        return data
    data.update(
        n_routed_experts=config.num_experts,
        num_experts_per_tok=config.num_experts_per_tok,
        moe_intermediate_size=expert_size(config),
        n_shared_experts=config.num_shared_experts,
        first_k_dense_replace=config.first_k_dense_replace,
        routed_scaling_factor=config.routed_scaling_factor,
        n_group=config.n_group,
        topk_group=config.topk_group,
        norm_topk_prob=config.norm_topk_prob,
        aux_loss_alpha=config.router_aux_loss_coef,
    )
    if model_type == "deepseek_v2":
        data["topk_method"] = config.router_topk_method
    return data


# ---------------------------------------------------------------------- weights
def _rope_rows(config: ModelConfig, key: str, tensor: torch.Tensor, inverse: bool) -> torch.Tensor:
    """Reorder the rotary output rows of a q / kv_a projection (interleaved <-> half-split)."""
    rope = config.qk_rope_head_dim
    half_split = torch.cat([torch.arange(0, rope, 2), torch.arange(1, rope, 2)])
    perm = torch.argsort(half_split) if inverse else half_split
    if key.endswith(("self_attn.q_proj.weight", "self_attn.q_b_proj.weight")):
        heads = config.num_attention_heads
        w = tensor.reshape(heads, config.qk_nope_head_dim + rope, -1)
        rot = w[:, config.qk_nope_head_dim :][:, perm]
        return torch.cat([w[:, : config.qk_nope_head_dim], rot], dim=1).reshape(tensor.shape)
    if key.endswith(("self_attn.kv_a_proj_with_mqa.weight", "self_attn.kv_a_proj_with_mqa.bias")):
        r = config.kv_lora_rank
        return torch.cat([tensor[:r], tensor[r:][perm]])
    return tensor


def state_from_hf(stored: dict[str, torch.Tensor], config: ModelConfig) -> dict[str, torch.Tensor]:
    """DeepSeek tensors (HF names, experts already stacked by hf_moe) -> ours: de-interleave
    the rotary rows, rename `shared_experts`, drop multi-token-prediction layers."""
    if config.attention_type != "mla":
        return stored
    out: dict[str, torch.Tensor] = {}
    dropped = 0
    for key, tensor in stored.items():
        layer = _LAYER.search(key)
        if layer is not None and int(layer.group(2)) >= config.num_hidden_layers:
            dropped += 1  # V3's next-token-prediction (MTP) layers: not part of the LM
            continue
        key = key.replace(".mlp.shared_experts.", ".mlp.shared_expert.")
        out[key] = _rope_rows(config, key, tensor, inverse=False)
    if dropped:
        logger.info("skipped %d tensors of layers >= num_hidden_layers (MTP)", dropped)
    return out


def state_to_hf(
    state: dict[str, torch.Tensor], config: ModelConfig, *, unstack: bool
) -> dict[str, torch.Tensor]:
    """Ours -> DeepSeek's layout: interleaved rotary rows, `shared_experts`, and (for an HF
    directory, `unstack`) per-expert tensors as DeepSeek checkpoints store them."""
    if config.attention_type != "mla":
        return state
    out = {}
    for key, tensor in state.items():
        key = key.replace(".mlp.shared_expert.", ".mlp.shared_experts.")
        out[key] = _rope_rows(config, key, tensor, inverse=True).contiguous()
    # DeepSeek's per-expert names are Qwen-MoE's (experts.<e>.gate_proj/up_proj/down_proj).
    return hf_moe.state_to_hf(out, "qwen3_moe") if unstack else out


__all__ = [
    "DEEPSEEK_ARCHITECTURES",
    "config_from_hf",
    "config_to_hf",
    "hf_deepseek_model_type",
    "state_from_hf",
    "state_to_hf",
]
