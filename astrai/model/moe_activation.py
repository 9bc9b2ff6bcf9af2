"""The activation of the routed experts, applied to each pair's ``[..., 2I]`` gate/up product
(gate half first): SwiGLU, or GPT-OSS's clamped variant. One callable per kind, so that every
dispatch path of `astrai.model.moe.Experts` computes the same function."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F


def swiglu(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` (Llama, Mixtral, Qwen, DeepSeek)."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


class ClampedSwiGLU:
    """GPT-OSS's ``(up + 1) * gate * sigmoid(alpha * gate)`` with ``gate <= limit`` and
    ``|up| <= limit`` (transformers' ``GptOssExperts._apply_gate``): the clamp bounds the
    activations the quantised checkpoints were trained with."""

    def __init__(self, limit: float, alpha: float) -> None:
        self.limit = limit
        self.alpha = alpha

    def __call__(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        gate = gate.clamp(max=self.limit)
        up = up.clamp(-self.limit, self.limit)
        return (up + 1) * (gate * torch.sigmoid(gate * self.alpha))


def expert_activation(config: Any) -> Callable[[torch.Tensor], torch.Tensor]:
    """The experts' activation of a `ModelConfig`: clamped when `swiglu_limit` is set."""
    if config.swiglu_limit is None:
        return swiglu
    return ClampedSwiGLU(config.swiglu_limit, config.swiglu_alpha)


__all__ = ["ClampedSwiGLU", "expert_activation", "swiglu"]
