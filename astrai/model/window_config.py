"""Sliding-window attention fields of `ModelConfig`: which layers attend locally, and checks.

HF's meaning (`transformers.masking_utils.sliding_window_overlay`): a query at position ``q``
sees keys ``k`` with ``q - sliding_window < k <= q``, i.e. the last ``sliding_window``
tokens including itself. ``layer_types`` (HF's name, Gemma/Qwen2 style) marks each layer
``"sliding_attention"`` or ``"full_attention"``; None means every layer uses the window.
"""

from __future__ import annotations

from typing import Any

LAYER_TYPES = ("sliding_attention", "full_attention")


def layer_window(config: Any, layer_id: int) -> int | None:
    """The window of layer `layer_id` of a `ModelConfig` (None: it attends to the whole
    prefix); `Any`, as in moe_config, so that config.py imports this module, not the reverse."""
    if config.sliding_window is None:
        return None
    if config.layer_types is not None and config.layer_types[layer_id] != "sliding_attention":
        return None
    return config.sliding_window


def window_problems(config: Any) -> list[str]:
    """What is wrong with `sliding_window` / `layer_types`, each message naming the field."""
    problems = []
    if config.sliding_window is not None and config.sliding_window <= 0:
        problems.append(
            f"ModelConfig.sliding_window: must be positive or null, got {config.sliding_window}"
        )
    types = config.layer_types
    if types is not None:
        if len(types) != config.num_hidden_layers:
            problems.append(
                f"ModelConfig.layer_types: expected {config.num_hidden_layers} entries "
                f"(num_hidden_layers), got {len(types)}"
            )
        bad = sorted({t for t in types if t not in LAYER_TYPES})
        if bad:
            problems.append(f"ModelConfig.layer_types: {bad} not among {list(LAYER_TYPES)}")
        if "sliding_attention" in types and config.sliding_window is None:
            problems.append("ModelConfig.layer_types: sliding layers need sliding_window set")
    if config.sliding_window is not None and config.attention_type == "mla":
        problems.append("ModelConfig.sliding_window: not supported with attention_type='mla'")
    return problems
