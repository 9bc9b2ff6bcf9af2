"""LongRoPE's cos/sin tables (`astrai.model.longrope` computes the frequencies).

Which set a token uses differs between the references. A training or scoring forward
follows transformers: the whole call uses the long factors once its longest position passes
`original_max_position_embeddings`, so logits equal `Phi3ForCausalLM`'s. The engine rotates
each token by its own position (short below the original context, long from it on), which
keeps a token's rotation independent of its batch and of how its prompt was chunked (vLLM
switches a whole batch when any token passes the original context); one token at a time it
is transformers' `generate` rule too.
"""

from __future__ import annotations

import torch

from astrai.model.config import ModelConfig
from astrai.model.longrope import longrope_inv_freq
from astrai.model.rope import RotaryEmbedding


class LongRopeEmbedding(RotaryEmbedding):
    """Two fp32 cos/sin tables, short and long, grown on demand like the base table."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__(config)
        self.original = int(config.rope_scaling["original_max_position_embeddings"])
        self.long_cos = self.long_sin = torch.empty(0)

    def materialize(self, device: torch.device) -> None:
        super().materialize(device)
        self.long_cos = self.long_sin = torch.empty(0, device=device)

    def _tables(self, length: int, device: torch.device) -> tuple[torch.Tensor, ...]:
        if self.long_cos.shape[0] < length or self.long_cos.device != device:
            size = max(length, min(self.config.max_position_embeddings, 8192))
            pos = torch.arange(size, device=device, dtype=torch.float32)
            tables = []
            with torch.inference_mode(False), torch.no_grad():
                for long in (False, True):
                    inv_freq, scale = longrope_inv_freq(self.config, long)
                    freqs = torch.outer(pos, inv_freq.to(device))
                    tables += [freqs.cos() * scale, freqs.sin() * scale]
            self.cos_cached, self.sin_cached, self.long_cos, self.long_sin = tables
        return self.cos_cached, self.sin_cached, self.long_cos, self.long_sin

    def forward(
        self,
        position_ids: torch.Tensor,
        max_position: int | None = None,
        *,
        per_token: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """As the base's; `per_token` (the engine): each token's set by its own position,
        else the call's longest position picks one set for all (transformers)."""
        if position_ids.device.type == "meta":
            return super().forward(position_ids, max_position)
        if max_position is None:
            max_position = int(position_ids.max())
        cos, sin, long_cos, long_sin = self._tables(max_position + 1, position_ids.device)
        if per_token:
            long = (position_ids >= self.original)[..., None]
            return (
                torch.where(long, long_cos[position_ids], cos[position_ids]),
                torch.where(long, long_sin[position_ids], sin[position_ids]),
            )
        if max_position + 1 > self.original:
            return long_cos[position_ids], long_sin[position_ids]
        return cos[position_ids], sin[position_ids]
