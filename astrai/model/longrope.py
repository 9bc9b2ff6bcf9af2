"""LongRoPE's frequencies (`rope_type: "longrope"`, Phi-3-*-128k, Phi-3.5, Phi-4-mini):
per-frequency rescale factors, one set for short and one for long contexts, and a cos/sin
scale. The tables and which set a token uses: `astrai.model.longrope_embedding`.
"""

from __future__ import annotations

import math

import torch

from astrai.model.config import ModelConfig


def longrope_inv_freq(config: ModelConfig, long: bool) -> tuple[torch.Tensor, float]:
    """Inverse frequencies (the `long_factor` or `short_factor` set) and the cos/sin scale,
    as transformers' `_compute_longrope_parameters` computes them."""
    scaling = config.rope_scaling or {}
    dim = config.rotary_dim()
    original = scaling["original_max_position_embeddings"]
    factor = scaling.get("factor") or config.max_position_embeddings / original
    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        attention_factor = (
            1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
        )
    ext = torch.tensor(scaling["long_factor" if long else "short_factor"], dtype=torch.float32)
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    return 1.0 / (ext * config.rope_theta**exponents), float(attention_factor)


def is_longrope(config: ModelConfig) -> bool:
    return (config.rope_scaling or {}).get("rope_type") == "longrope"
