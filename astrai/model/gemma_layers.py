"""Gemma 3's layers beyond Llama's: the (1 + w) RMSNorm, embeddings scaled by sqrt(hidden),
and RoPE per layer type (sliding-window layers rotate with `rope_local_base_freq`).

Each is chosen once, from a `ModelConfig` field, by a factory here (`norm_class`,
`make_embedding`, `make_rotary`), so the Transformer and its blocks hold no Gemma branches.
Formulas follow transformers' `modeling_gemma3.py` so that Gemma 3 checkpoints give equal logits.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from astrai.model.config import ModelConfig
from astrai.model.gemma_config import local_rope_config
from astrai.model.layers import RMSNorm
from astrai.model.longrope import is_longrope
from astrai.model.longrope_embedding import LongRopeEmbedding
from astrai.model.rope import RotaryEmbedding


class GemmaRMSNorm(RMSNorm):
    """x * rsqrt(mean(x^2) + eps) * (1 + w), all in fp32 and cast back once (Gemma casts after
    the weight, Llama before); the weight starts at zero, i.e. the identity scale."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__(dim, eps)
        self.reset_parameters()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scale = 1.0 + self.weight.float()
        return F.rms_norm(x.float(), (x.shape[-1],), scale, self.eps).to(x.dtype)

    def reset_parameters(self) -> None:
        nn.init.zeros_(self.weight)


#: the norm class of each `ModelConfig.norm_type` (astrai/model/gemma_config.py)
NORMS: dict[str, type[RMSNorm]] = {"rms": RMSNorm, "gemma": GemmaRMSNorm}


def norm_class(config: ModelConfig) -> type[RMSNorm]:
    """The RMSNorm every norm of a `config` model uses (blocks, final, per-head q/k)."""
    return NORMS[config.norm_type]


_FLOATS = (torch.float64, torch.float32, torch.bfloat16, torch.float16)


class ScaledEmbedding(nn.Embedding):
    """Embedding rows times `scale` (Gemma: sqrt(hidden_size)); the scale is rounded to the
    weight's dtype first, as transformers does (bf16: sqrt(3072) = 55.5, not 55.43)."""

    def __init__(self, num_embeddings: int, embedding_dim: int, scale: float) -> None:
        super().__init__(num_embeddings, embedding_dim)
        self.scale = scale
        # rounded on the host once per dtype: a forward makes no tensor (CUDA graphs, compile)
        self.rounded = {t: torch.tensor(scale, dtype=t, device="cpu").item() for t in _FLOATS}

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return super().forward(input_ids) * self.rounded[self.weight.dtype]


def make_embedding(config: ModelConfig) -> nn.Embedding:
    """The token embedding of `config`: scaled by sqrt(hidden_size) when `scale_embeddings`."""
    if config.scale_embeddings:
        return ScaledEmbedding(config.vocab_size, config.hidden_size, config.hidden_size**0.5)
    return nn.Embedding(config.vocab_size, config.hidden_size)


class LayerTypeRotary(nn.Module):
    """Two RoPE tables: the configured one for full-attention layers, and `rope_theta =
    rope_local_base_freq` without scaling for sliding-window layers (Gemma 3's
    `rope_parameters["sliding_attention"]`); each layer gets the cos/sin of its type."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.full = RotaryEmbedding(config)
        self.local = RotaryEmbedding(local_rope_config(config))
        self.sliding = [config.layer_window(i) is not None for i in range(config.num_hidden_layers)]

    def materialize(self, device: torch.device) -> None:
        """Drop tables built on another device (see `RotaryEmbedding.materialize`)."""
        self.full.materialize(device)
        self.local.materialize(device)

    def layer_tables(
        self,
        position_ids: torch.Tensor,
        max_position: int | None = None,
        *,
        per_token: bool = False,
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(cos, sin) for each layer, by its type (`per_token`: as `RotaryEmbedding`'s)."""
        if max_position is None and position_ids.device.type != "meta":
            max_position = int(position_ids.max())  # one device sync for both tables
        full = self.full(position_ids, max_position, per_token=per_token)
        local = self.local(position_ids, max_position, per_token=per_token)
        return [local if sliding else full for sliding in self.sliding]


def make_rotary(config: ModelConfig) -> RotaryEmbedding | LayerTypeRotary:
    """The RoPE of `config`: one table per layer type when `rope_local_base_freq` is set,
    LongRoPE's short and long tables, or one table."""
    if config.rope_local_base_freq is not None:
        return LayerTypeRotary(config)
    if is_longrope(config):
        return LongRopeEmbedding(config)
    return RotaryEmbedding(config)
