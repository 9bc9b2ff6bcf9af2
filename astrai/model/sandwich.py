"""Gemma 3's "sandwich" block (`ModelConfig.norm_position="sandwich"`): a norm before and
after each sub-layer, x + post_norm(f(pre_norm(x))), for attention and for the MLP."""

from __future__ import annotations

import torch
from torch import nn

from astrai.extension import KVCache
from astrai.model.config import ModelConfig
from astrai.model.documents import DocumentSpans
from astrai.model.gemma_layers import norm_class
from astrai.model.mla import make_attention
from astrai.model.moe import make_mlp


class SandwichBlock(nn.Module):
    """x + post_attention_layernorm(attn(input_layernorm(x))), then
    x + post_feedforward_layernorm(mlp(pre_feedforward_layernorm(x))); HF Gemma 3's names."""

    def __init__(self, config: ModelConfig, layer_id: int) -> None:
        super().__init__()
        norm = norm_class(config)
        h, eps = config.hidden_size, config.rms_norm_eps
        self.layer_id = layer_id
        self.input_layernorm = norm(h, eps)
        self.self_attn = make_attention(config, layer_id)
        self.post_attention_layernorm = norm(h, eps)
        self.pre_feedforward_layernorm = norm(h, eps)
        self.mlp = make_mlp(config, layer_id)
        self.post_feedforward_layernorm = norm(h, eps)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        attn_mask: torch.Tensor | DocumentSpans | None = None,
    ) -> torch.Tensor:
        attn = self.self_attn(self.input_layernorm(x), cos, sin, attn_mask)
        x = x + self.post_attention_layernorm(attn)
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))

    def forward_cached(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv_cache: KVCache
    ) -> torch.Tensor:
        attn = self.self_attn.forward_cached(self.input_layernorm(x), cos, sin, kv_cache)
        x = x + self.post_attention_layernorm(attn)
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))
