"""Seam for the Triton attention backend (paged decode with split-KV, ragged prefill).

The kernels land in a later issue, in `astrai.extension.ops`. Until then this backend
reports itself unavailable, so automatic selection passes over it and an explicit
selection (`ASTR_BACKEND=triton`, `attn_backend("triton")`) fails loudly instead of
quietly running something else.
"""

from __future__ import annotations

import torch

from astrai.extension.backend.base import AttentionBackend, BackendUnavailable
from astrai.extension.kv_cache import KVCache

_NOT_BUILT = "triton attention kernels are not built yet (astrai.extension.ops has none)"


class TritonBackend(AttentionBackend):
    """Triton paged-attention kernels; currently never available."""

    name = "triton"

    def supports(self, q: torch.Tensor, kv_cache: KVCache) -> str | None:
        return _NOT_BUILT

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: KVCache,
        layer_id: int,
        scale: float,
    ) -> torch.Tensor:
        raise BackendUnavailable(f"attention backend 'triton': {_NOT_BUILT}")
