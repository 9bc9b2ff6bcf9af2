"""The `config.json` fields every Hugging Face decoder architecture shares, in one place for
the dense (`hub`), mixture-of-experts (`hf_moe`) and DeepSeek (`hf_deepseek`) exports."""

from __future__ import annotations

from typing import Any

import torch

from astrai.model.config import ModelConfig


def hf_base_fields(
    config: ModelConfig, architecture: str, model_type: str, dtype: torch.dtype
) -> dict[str, Any]:
    """Architecture, sizes, RoPE (both the old `rope_scaling` and the new `rope_parameters`
    spelling), embeddings, special tokens and dtype of an HF `config.json`."""
    rope_parameters = {"rope_type": "default", "rope_theta": config.rope_theta}
    if config.rope_scaling:
        rope_parameters.update(config.rope_scaling)
    return {
        "architectures": [architecture],
        "model_type": model_type,
        "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_hidden_layers": config.num_hidden_layers,
        "num_attention_heads": config.num_attention_heads,
        "hidden_act": "silu",
        "max_position_embeddings": config.max_position_embeddings,
        "rms_norm_eps": config.rms_norm_eps,
        "rope_theta": config.rope_theta,
        "rope_scaling": dict(config.rope_scaling) if config.rope_scaling else None,
        "rope_parameters": rope_parameters,
        "tie_word_embeddings": config.tie_word_embeddings,
        "attention_dropout": 0.0,
        "initializer_range": config.initializer_range,
        "bos_token_id": config.bos_token_id,
        "eos_token_id": config.eos_token_id,
        "pad_token_id": config.pad_token_id,
        "torch_dtype": str(dtype).removeprefix("torch."),
        "use_cache": True,
    }
