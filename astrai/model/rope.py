"""Rotary position embeddings: the frequencies of each RoPE variant (HF's `rope_type`s), the
fp32 cos/sin table the model indexes by position, and the q/k rotation of a whole or partial
head. `Transformer` owns one table (`astrai.model.gemma_layers.make_rotary` picks a per-layer-
type or LongRoPE one where the config asks); `Attention.project` rotates through `rotary_for`.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from astrai.extension import apply_rotary_emb, apply_rotary_qk
from astrai.model.config import ModelConfig
from astrai.model.longrope import longrope_inv_freq


def rope_inv_freq(config: ModelConfig, seq_len: int | None = None) -> tuple[torch.Tensor, float]:
    """Inverse frequencies and cos/sin scale for the configured RoPE variant.

    Formulas follow the published methods (and Hugging Face's implementation of them), so
    that HF checkpoints produce identical logits. `seq_len` only matters for dynamic NTK and
    LongRoPE.
    """
    dim = config.rotary_dim()
    base = config.rope_theta
    scaling = config.rope_scaling or {"rope_type": "default"}
    kind = scaling["rope_type"]
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).to(torch.float32) / dim

    if kind == "default":
        return 1.0 / (base**exponents), 1.0
    if kind == "linear":
        return 1.0 / (base**exponents) / scaling["factor"], 1.0
    if kind == "dynamic":
        factor = scaling["factor"]
        max_pos = config.max_position_embeddings
        seq_len = max(seq_len or max_pos, max_pos)
        base = base * ((factor * seq_len / max_pos) - (factor - 1)) ** (dim / (dim - 2))
        return 1.0 / (base**exponents), 1.0
    if kind == "llama3":
        inv_freq = 1.0 / (base**exponents)
        factor = scaling["factor"]
        low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_ctx = scaling.get("original_max_position_embeddings", config.max_position_embeddings)
        low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_ctx / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
        return torch.where(medium, smoothed, scaled), 1.0
    if kind == "yarn":
        return _yarn_inv_freq(config, scaling, exponents)
    if kind == "longrope":  # the set a call's longest position picks, as transformers
        original = scaling["original_max_position_embeddings"]
        return longrope_inv_freq(config, long=seq_len is not None and seq_len > original)
    raise ValueError(f"rope_scaling.rope_type: unsupported {kind!r}")


def _yarn_inv_freq(
    config: ModelConfig, scaling: dict, exponents: torch.Tensor
) -> tuple[torch.Tensor, float]:
    dim, base = config.rotary_dim(), config.rope_theta
    original = scaling.get("original_max_position_embeddings", config.max_position_embeddings)
    factor = scaling.get("factor") or config.max_position_embeddings / original

    def get_mscale(scale: float, mscale: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0

    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            attention_factor = get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim)
        else:
            attention_factor = get_mscale(factor)
    beta_fast = scaling.get("beta_fast") or 32
    beta_slow = scaling.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).to(torch.float32) / dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    keep = 1 - ramp
    return interpolation * (1 - keep) + extrapolation * keep, float(attention_factor)


class RotaryEmbedding(nn.Module):
    """fp32 cos/sin table indexed by position id (half-split "rotate_half" convention).

    The table grows on demand, so long positions never index out of range. Dynamic NTK
    recomputes frequencies from the longest position in the call, as Hugging Face does.
    """

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.dynamic = (config.rope_scaling or {}).get("rope_type") == "dynamic"
        _, self.attention_scaling = rope_inv_freq(config)
        # A cache, not module state: plain attributes, so DDP never broadcasts a table that
        # ranks grew to different lengths, and `.to()` is unnecessary (rebuilt per device).
        self.cos_cached = torch.empty(0)
        self.sin_cached = torch.empty(0)

    def materialize(self, device: torch.device) -> None:
        """Drop a table built on another device (e.g. meta); it is rebuilt on first use."""
        self.cos_cached = torch.empty(0, device=device)
        self.sin_cached = torch.empty(0, device=device)

    def _table(self, length: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        if self.cos_cached.shape[0] < length or self.cos_cached.device != device:
            size = max(length, min(self.config.max_position_embeddings, 8192))
            # A plain tensor even when first built under inference mode, so training can use it.
            with torch.inference_mode(False), torch.no_grad():
                inv_freq, _ = rope_inv_freq(self.config)
                pos = torch.arange(size, device=device, dtype=torch.float32)
                freqs = torch.outer(pos, inv_freq.to(device))
                self.cos_cached = freqs.cos() * self.attention_scaling
                self.sin_cached = freqs.sin() * self.attention_scaling
        return self.cos_cached, self.sin_cached

    def forward(
        self,
        position_ids: torch.Tensor,
        max_position: int | None = None,
        *,
        per_token: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin of shape `position_ids.shape + (head_dim // 2,)`, fp32.

        `max_position` (an upper bound of the ids, known on the host) spares the device
        sync of computing it; the inference hot path always passes it. `per_token` (the
        engine's calls) matters to LongRoPE only (`astrai.model.longrope`).
        """
        if position_ids.device.type == "meta":
            shape = (*position_ids.shape, self.config.rotary_dim() // 2)
            return torch.empty(shape, device="meta"), torch.empty(shape, device="meta")
        if max_position is None:
            max_position = int(position_ids.max())
        max_len = max_position + 1
        if self.dynamic and max_len > self.config.max_position_embeddings:
            inv_freq, _ = rope_inv_freq(self.config, seq_len=max_len)
            freqs = position_ids.to(torch.float32)[..., None] * inv_freq.to(position_ids.device)
            return freqs.cos(), freqs.sin()
        cos, sin = self._table(max_len, position_ids.device)
        return cos[position_ids], sin[position_ids]

    def layer_tables(
        self,
        position_ids: torch.Tensor,
        max_position: int | None = None,
        *,
        per_token: bool = False,
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(cos, sin) for each layer: the same table for all (a per-layer-type RoPE,
        `astrai.model.gemma_layers.LayerTypeRotary`, answers the same call)."""
        tables = self(position_ids, max_position, per_token=per_token)
        return [tables] * self.config.num_hidden_layers


# RoPE itself lives in the extension layer, which dispatches to a fused kernel when one
# can serve the call; training and serving therefore rotate through the same function.
apply_rotary = apply_rotary_emb


class PartialRotary:
    """RoPE on the first `dim` dims of each head only, the rest passed through (Phi-4-mini's
    `partial_rotary_factor`); the same call as `apply_rotary_qk`, so training and the engine
    (both go through `Attention.project`) rotate alike."""

    def __init__(self, dim: int) -> None:
        self.dim = dim

    def __call__(
        self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        d = self.dim
        q_rot, k_rot = apply_rotary_qk(q[..., :d].contiguous(), k[..., :d].contiguous(), cos, sin)
        return torch.cat((q_rot, q[..., d:]), -1), torch.cat((k_rot, k[..., d:]), -1)


def rotary_for(config: ModelConfig):
    """The q/k rotation of `config`: all of each head, or its first `rotary_dim()` dims."""
    if config.rotary_dim() == config.head_dim:
        return apply_rotary_qk
    return PartialRotary(config.rotary_dim())
