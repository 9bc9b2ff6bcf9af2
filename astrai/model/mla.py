"""Multi-head latent attention (DeepSeek-V2/V3) and `make_attention`, the block's factory.

MLA compresses keys and values into one latent vector per token (`kv_lora_rank`, normed by
`kv_a_layernorm`) plus a rotary key shared by all heads (`qk_rope_head_dim`). Training
decompresses the latent with `kv_b_proj` into per-head keys and values; inference caches only
`[latent, rotary key]` per token and attends in the latent space with the absorbed
projections (queries through W_UK, outputs through W_UV), which is why MLA's KV cache is
small. Parameter names are Hugging Face's, so DeepSeek checkpoints map by name.

RoPE here is the half-split ("rotate_half") convention of the rest of the model; DeepSeek's
interleaved rotary weights are de-interleaved once at import (astrai/model/hf_deepseek.py).
"""

from __future__ import annotations

import torch
from torch import nn

from astrai.extension import KVCache, apply_rotary_emb, invariant_rows
from astrai.extension.mla import latent_attention
from astrai.model.config import ModelConfig
from astrai.model.documents import DocumentSpans, training_attention
from astrai.model.gemma_layers import norm_class
from astrai.model.layers import Attention, Linear, RMSNorm
from astrai.model.mla_config import mla_softmax_scale

# DeepSeek's q_a_layernorm / kv_a_layernorm use RMSNorm's default eps, not rms_norm_eps.
LATENT_NORM_EPS = 1e-6


class MLAttention(nn.Module):
    """DeepSeek's multi-head latent attention: low-rank q (optional) and a compressed KV latent."""

    def __init__(self, config: ModelConfig, layer_id: int) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.num_heads = h = config.num_attention_heads
        self.q_lora_rank = config.q_lora_rank
        self.kv_lora_rank = config.kv_lora_rank
        self.nope_dim = config.qk_nope_head_dim
        self.rope_dim = config.qk_rope_head_dim
        self.v_head_dim = config.v_head_dim
        self.qk_head_dim = self.nope_dim + self.rope_dim
        self.scale = mla_softmax_scale(config)
        hidden, bias = config.hidden_size, config.attention_bias
        if self.q_lora_rank is None:
            self.q_proj = Linear(hidden, h * self.qk_head_dim, bias=False)
        else:
            self.q_a_proj = Linear(hidden, self.q_lora_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(self.q_lora_rank, LATENT_NORM_EPS)
            self.q_b_proj = Linear(self.q_lora_rank, h * self.qk_head_dim, bias=False)
        self.kv_a_proj_with_mqa = Linear(hidden, self.kv_lora_rank + self.rope_dim, bias=bias)
        self.kv_a_layernorm = RMSNorm(self.kv_lora_rank, LATENT_NORM_EPS)
        self.kv_b_proj = Linear(
            self.kv_lora_rank, h * (self.nope_dim + self.v_head_dim), bias=False
        )
        self.o_proj = Linear(h * self.v_head_dim, hidden, bias=config.o_proj_bias)

    # ------------------------------------------------------------------ projections
    def query(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """q_nope `[..., H, nope]` and the rotated q_pe `[..., H, rope]`."""
        if self.q_lora_rank is None:
            q = self.q_proj(x)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q = q.view(*x.shape[:-1], self.num_heads, self.qk_head_dim)
        q_nope, q_pe = q.split((self.nope_dim, self.rope_dim), dim=-1)
        return q_nope, apply_rotary_emb(q_pe, cos, sin)

    def latent(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The normed KV latent `[..., kv_lora_rank]` and the rotated shared key `[..., rope]`."""
        c_kv, k_pe = self.kv_a_proj_with_mqa(x).split((self.kv_lora_rank, self.rope_dim), dim=-1)
        k_pe = apply_rotary_emb(k_pe.unsqueeze(-2), cos, sin).squeeze(-2)
        return self.kv_a_layernorm(c_kv), k_pe

    def absorbed(self) -> tuple[torch.Tensor, torch.Tensor]:
        """W_UK `[H, nope, r]` and W_UV `[H, v, r]`: kv_b_proj's key and value halves per head.

        A wrapped projection without a plain `weight` (a LoRA adapter) is materialised by
        applying it to the identity, so its update is part of the absorbed matrices too.
        """
        w = getattr(self.kv_b_proj, "weight", None)
        if not isinstance(w, torch.Tensor):
            ref = self.kv_a_layernorm.weight
            eye = torch.eye(self.kv_lora_rank, dtype=ref.dtype, device=ref.device)
            w = self.kv_b_proj(eye).T
        w = w.reshape(self.num_heads, self.nope_dim + self.v_head_dim, -1)
        return w[:, : self.nope_dim], w[:, self.nope_dim :]

    # ------------------------------------------------------------------ forward
    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        attn_mask: torch.Tensor | DocumentSpans | None = None,
    ) -> torch.Tensor:
        """Dense `[B, S, H]` path (training): the latent is decompressed into per-head K/V."""
        b, s, _ = x.shape
        q_nope, q_pe = self.query(x, cos, sin)
        c_kv, k_pe = self.latent(x, cos, sin)
        kv = self.kv_b_proj(c_kv).view(b, s, self.num_heads, self.nope_dim + self.v_head_dim)
        k_nope, v = kv.split((self.nope_dim, self.v_head_dim), dim=-1)
        k_pe = k_pe.unsqueeze(-2).expand(b, s, self.num_heads, self.rope_dim)
        q = torch.cat((q_nope, q_pe), dim=-1)
        k = torch.cat((k_nope, k_pe), dim=-1)
        out = training_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask, scale=self.scale
        )
        return self.o_proj(out.transpose(1, 2).reshape(b, s, -1))

    def forward_cached(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv_cache: KVCache
    ) -> torch.Tensor:
        """Packed `[T, H]` inference path in the latent space.

        The cache holds `[latent, k_pe]` per token; the query becomes `[q_nope @ W_UK, q_pe]`,
        so scores equal the decompressed ones, and the attended latent goes through W_UV.
        """
        q_nope, q_pe = self.query(x, cos, sin)
        c_kv, k_pe = self.latent(x, cos, sin)
        w_uk, w_uv = self.absorbed()
        # row by row over the tokens: fixed blocks in batch-invariant mode (astrai.extension)
        q_lat = invariant_rows(q_nope, lambda z: torch.einsum("thn,hnr->thr", z, w_uk))
        out = latent_attention(
            torch.cat((q_lat, q_pe), dim=-1),
            torch.cat((c_kv, k_pe), dim=-1),
            kv_cache,
            self.layer_id,
            scale=self.scale,
            value_dim=self.kv_lora_rank,
        )
        out = invariant_rows(out, lambda z: torch.einsum("thr,hvr->thv", z, w_uv))
        return self.o_proj(out.reshape(x.shape[0], -1))


def make_attention(config: ModelConfig, layer_id: int) -> nn.Module:
    """The self-attention module of block `layer_id`: GQA `Attention` or MLA."""
    if config.attention_type == "mla":
        return MLAttention(config, layer_id)
    return Attention(config, layer_id, norm_class(config))
