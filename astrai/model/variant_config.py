"""Checks of the block-variant fields of `ModelConfig` (post-norm and sandwich blocks,
whole-projection q/k norm, partial rotary), kept apart so that `config.py` stays torch-free and short."""

from __future__ import annotations

from typing import Any

NORM_POSITIONS = ("pre", "post", "sandwich")
QK_NORM_SCOPES = ("head", "projection")


def variant_problems(config: Any) -> list[str]:
    """What is wrong with `config`'s variant fields (messages name the field); [] if nothing."""
    problems = []
    if config.norm_position not in NORM_POSITIONS:
        problems.append(
            f"ModelConfig.norm_position: {config.norm_position!r} is not one of "
            f"{list(NORM_POSITIONS)}"
        )
    if config.qk_norm_scope not in QK_NORM_SCOPES:
        problems.append(
            f"ModelConfig.qk_norm_scope: {config.qk_norm_scope!r} is not one of "
            f"{list(QK_NORM_SCOPES)}"
        )
    factor = config.partial_rotary_factor
    if not 0 < factor <= 1:
        problems.append(f"ModelConfig.partial_rotary_factor: must be in (0, 1], got {factor}")
    elif int(config.head_dim * factor) % 2 or int(config.head_dim * factor) == 0:
        problems.append(
            "ModelConfig.partial_rotary_factor: head_dim * partial_rotary_factor must be a "
            f"positive even number, got {config.head_dim} * {factor}"
        )
    if config.attention_type == "mla" and (
        factor != 1 or config.qk_norm_scope != "head" or config.norm_position != "pre"
    ):
        problems.append(
            "ModelConfig.attention_type: 'mla' takes no partial_rotary_factor, "
            "qk_norm_scope or norm_position variant"
        )
    return problems
