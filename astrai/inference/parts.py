"""The engine's optional and sized parts, built from its settings: the model's KV pool and
the speculation proposer (`NoProposer` when speculation is off; the adapters' registry is
`EngineAdapters.build`)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

from astrai.inference.cache import PagePool
from astrai.inference.draft import DraftModelProposer
from astrai.inference.ngram import NgramProposer
from astrai.inference.speculative import NO_PROPOSER, Proposer, SpeculativeConfig
from astrai.model import Transformer
from astrai.model.mla_config import kv_geometry


def kv_pool(
    model: Transformer,
    *,
    max_batch_size: int,
    max_seq_len: int | None,
    cache_mode: Literal["contiguous", "paged"],
    page_size: int,
    kv_tokens: int | None,
    memory_fraction: float | None,
    prefix_cache: bool | None,
) -> PagePool:
    """The KV pool of `model` on its device and dtype (`InferenceEngine`'s settings);
    `max_seq_len` None: `min(max_position_embeddings, 4096)`."""
    cfg = model.config
    param = next(model.parameters())
    return PagePool(
        num_layers=cfg.num_hidden_layers,
        **kv_geometry(cfg),  # K/V per kv head, or MLA's latent (astrai/model/mla_config.py)
        dtype=param.dtype,
        device=param.device,
        max_batch_size=max_batch_size,
        max_seq_len=max_seq_len or min(cfg.max_position_embeddings, 4096),
        mode=cache_mode,
        page_size=page_size,
        kv_tokens=kv_tokens,
        memory_fraction=memory_fraction,
        enable_radix=prefix_cache,
    )


def make_proposer(
    speculative: SpeculativeConfig | Mapping[str, Any] | None,
    model: Transformer,
    max_batch_size: int,
    max_seq_len: int | None,
) -> Proposer:
    """The proposer of the engine's checked `speculative` setting (`NO_PROPOSER`: off)."""
    config = SpeculativeConfig.of(speculative)
    if config is None:
        return NO_PROPOSER
    if config.method == "ngram":
        return NgramProposer(config)
    return DraftModelProposer(config, model, max_batch_size, max_seq_len)


__all__ = ["kv_pool", "make_proposer"]
