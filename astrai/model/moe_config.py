"""Mixture-of-experts fields of `ModelConfig`: their checks and which layers are sparse.

Kept apart from `config.py` so the dense configuration stays readable; `ModelConfig.validate`
raises the first problem this module reports, and `ModelConfig.is_moe_layer` delegates here.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

ROUTER_SCORINGS = ("softmax", "sigmoid")
ROUTER_TOPK_METHODS = ("greedy", "group_limited_greedy", "noaux_tc")


def as_list(value: Any) -> Any:
    """A list from any non-string sequence (a tuple, Hydra's ListConfig); anything else as is,
    for the type check to name."""
    if isinstance(value, list | str | bytes | dict) or not isinstance(value, Sequence):
        return value
    return list(value)


def moe_layer(config: Any, layer_id: int) -> bool:
    """True when block `layer_id` routes to experts.

    Qwen-MoE: not in `mlp_only_layers` and `(layer_id + 1) % decoder_sparse_step == 0`;
    DeepSeek: `layer_id >= first_k_dense_replace`. Both rules hold at once (defaults are no-ops).
    """
    if config.num_experts <= 0:
        return False
    if layer_id in config.mlp_only_layers or layer_id < config.first_k_dense_replace:
        return False
    return (layer_id + 1) % config.decoder_sparse_step == 0


def moe_problems(config: Any) -> list[str]:
    """Every violated MoE constraint, each message naming its `ModelConfig.<field>`."""
    out: list[str] = []

    def bad(field: str, why: str) -> None:
        out.append(f"ModelConfig.{field}: {why}, got {getattr(config, field)!r}")

    if config.num_experts < 0:
        bad("num_experts", "must be >= 0 (0 = dense)")
    if config.num_shared_experts < 0:
        bad("num_shared_experts", "must be >= 0")
    if config.router_aux_loss_coef < 0:
        bad("router_aux_loss_coef", "must be >= 0")
    if config.router_z_loss_coef < 0:
        bad("router_z_loss_coef", "must be >= 0")
    if config.num_experts == 0:
        return out
    if config.num_experts_per_tok < 1:
        bad("num_experts_per_tok", "must be >= 1")
    elif config.num_experts_per_tok > config.num_experts:
        bad("num_experts_per_tok", f"must be <= num_experts ({config.num_experts})")
    for name in ("moe_intermediate_size", "shared_expert_intermediate_size"):
        value = getattr(config, name)
        if value is not None and value <= 0:
            bad(name, "must be positive")
    if config.router_scoring not in ROUTER_SCORINGS:
        bad("router_scoring", f"must be one of {list(ROUTER_SCORINGS)}")
    if config.router_topk_method not in ROUTER_TOPK_METHODS:
        bad("router_topk_method", f"must be one of {list(ROUTER_TOPK_METHODS)}")
    if config.n_group < 1 or config.num_experts % config.n_group:
        bad("n_group", f"must be >= 1 and divide num_experts ({config.num_experts})")
    elif not 1 <= config.topk_group <= config.n_group:
        bad("topk_group", f"must be in [1, n_group={config.n_group}]")
    elif config.router_topk_method != "greedy":
        per_group = config.num_experts // config.n_group
        if config.topk_group * per_group < config.num_experts_per_tok:
            bad(
                "topk_group",
                f"topk_group * experts per group ({per_group}) must be >= num_experts_per_tok "
                f"({config.num_experts_per_tok})",
            )
        if config.router_topk_method == "noaux_tc" and per_group < 2:
            bad("n_group", "noaux_tc scores a group by its top-2 experts: needs >= 2 per group")
    if config.routed_scaling_factor <= 0:
        bad("routed_scaling_factor", "must be positive")
    if config.decoder_sparse_step < 1:
        bad("decoder_sparse_step", "must be >= 1")
    if config.first_k_dense_replace < 0:
        bad("first_k_dense_replace", "must be >= 0")
    layers = config.num_hidden_layers
    wrong = [i for i in config.mlp_only_layers if not 0 <= i < layers]
    if wrong:
        bad("mlp_only_layers", f"layer ids must lie in [0, {layers})")
    if config.shared_expert_gate and config.num_shared_experts == 0:
        bad("shared_expert_gate", "needs num_shared_experts >= 1")
    return out


def expert_size(config: Any) -> int:
    """Intermediate size of one routed expert (`moe_intermediate_size`, else the dense one)."""
    return config.moe_intermediate_size or config.intermediate_size


def shared_size(config: Any) -> int:
    """Intermediate size of the shared-expert MLP (all shared experts fused into one)."""
    if config.shared_expert_intermediate_size is not None:
        return config.shared_expert_intermediate_size
    return expert_size(config) * config.num_shared_experts


def moe_param_delta(config: Any) -> int:
    """Parameters the sparse layers add over dense MLPs (router, experts, shared expert, gate)."""
    h = config.hidden_size
    per_layer = (
        config.num_experts * (3 * h * expert_size(config) + h) - 3 * h * config.intermediate_size
    )
    if config.num_shared_experts:
        per_layer += 3 * h * shared_size(config) + (h if config.shared_expert_gate else 0)
    sparse = sum(moe_layer(config, i) for i in range(config.num_hidden_layers))
    return sparse * per_layer


__all__ = [
    "ROUTER_SCORINGS",
    "ROUTER_TOPK_METHODS",
    "as_list",
    "expert_size",
    "moe_layer",
    "moe_param_delta",
    "moe_problems",
    "shared_size",
]
