"""The engine's optional and sized parts, built from its settings: the model's packed (or
quantized) projections, its KV pool and the speculation proposer (`NoProposer` when speculation is off; the adapters' registry is
`EngineAdapters.build`)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

import torch

from astrai.inference.cache import PagePool
from astrai.inference.cache.kv_dtype import check_kv_cache_dtype
from astrai.inference.draft import DraftModelProposer
from astrai.inference.ngram import NgramProposer
from astrai.inference.speculative import NO_PROPOSER, Proposer, SpeculativeConfig
from astrai.model import Transformer
from astrai.model.mla_config import kv_geometry
from astrai.model.packed import NoPacks, ProjectionPacks, prepack_rows


def projection_packs(
    model: Transformer, packed: bool, quantization: str | None, max_batch_size: int
) -> ProjectionPacks:
    """The model's inference projections: fused and pre-packed for `max_batch_size` rows
    (`packed`), or each quantized alone (`quantization` without `packed`), or none. The LM
    head stays fp32: its logits feed sampling and log-probs."""
    if packed:
        return ProjectionPacks(
            model, prepack_rows(max_batch_size), quantization, keep_fp32=(model.lm_head,)
        )
    if quantization:
        return ProjectionPacks(model, None, quantization, fuse=False, keep_fp32=(model.lm_head,))
    return NoPacks()


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
    kv_cache_dtype: str = "auto",
) -> PagePool:
    """The KV pool of `model` on its device and dtype (`InferenceEngine`'s settings);
    `max_seq_len` None: `min(max_position_embeddings, 4096)`; `kv_cache_dtype` "int8"
    (`astrai.inference.cache.kv_dtype`) is checked against what serves it, before allocating."""
    cfg = model.config
    param = next(model.parameters())
    dtype = param.dtype
    if check_kv_cache_dtype(kv_cache_dtype) == "int8":
        _check_int8_kv(cfg, param)
        dtype = torch.int8
    return PagePool(
        num_layers=cfg.num_hidden_layers,
        **kv_geometry(cfg),  # K/V per kv head, or MLA's latent (astrai/model/mla_config.py)
        dtype=dtype,
        device=param.device,
        max_batch_size=max_batch_size,
        max_seq_len=max_seq_len or min(cfg.max_position_embeddings, 4096),
        mode=cache_mode,
        page_size=page_size,
        kv_tokens=kv_tokens,
        memory_fraction=memory_fraction,
        enable_radix=prefix_cache,
        window=model_window(cfg),
    )


def model_window(cfg: Any) -> int | None:
    """The sliding window every layer of `cfg` keeps (the largest), or None when a layer
    attends to the whole prefix (Gemma 3's global layers): how far back a paged row's KV
    is read."""
    windows = [cfg.layer_window(i) for i in range(cfg.num_hidden_layers)]
    if not windows or any(w is None for w in windows):
        return None
    return max(windows)


def _check_int8_kv(cfg: Any, param: torch.Tensor) -> None:
    """What an int8 KV cache needs: the CPU kernel reads it, for fp32 per-head K/V."""
    from astrai.extension.cpu_kernels import paged_attention_op

    why = None
    if param.device.type != "cpu":
        why = f"it is a CPU-engine option, the model is on {param.device.type}"
    elif param.dtype != torch.float32:
        why = f"it needs an fp32 model, this one is {param.dtype}"
    elif cfg.attention_type == "mla":
        why = "MLA's latent cache has no per-head K/V to scale"
    elif paged_attention_op() is None:
        why = "the CPU attention kernel is not built (`make setup`) or ASTR_CPU_KERNELS=0"
    if why is not None:
        raise ValueError(f"kv_cache_dtype='int8' cannot be used: {why}")


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
