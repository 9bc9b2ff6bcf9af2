"""The engine's `batch_invariant` option: which settings it needs, which it refuses.

With it on, a request's token ids and log-probs do not depend on what else runs in the
engine's steps (vLLM's `VLLM_BATCH_INVARIANT`, SGLang's `--enable-deterministic-inference`):
a GRPO rollout group generated alone on a server replica equals the same group generated in
a colocated batch, bit for bit. The kernels' side is `astrai.extension.invariance` (products
in fixed row blocks, attention per request), the runner enters it around each forward; the
scheduler's side is fixed prefill chunks (`InferenceScheduler(batch_invariant=True)`).

Refused with it, each with a ValueError naming both keys (checked before anything is
allocated): `prefix_cache=true` (a cached page's KV was computed within another request's
prefill chunk, whose length changes its bits; `null` resolves to off), `speculative`
(drafts change which rows a step verifies), `decode_graphs` true or `"stand-in"` (captured
batch sizes pad the decode batch; `null` resolves to eager), `kv_cache_dtype=int8` (only the
CPU kernel reads an int8 cache, and invariant attention is torch_native's per request), and
for a model with dynamic
RoPE a `max_seq_len` beyond its `max_position_embeddings`. LoRA adapters (served ones and
a training run's live adapter) are made invariant (`astrai.extension.lora`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from astrai.model.config import ModelConfig


@dataclass(frozen=True)
class BatchInvariance:
    """`batch_invariant` checked against the settings it cannot run with; `prefix_cache` and
    `decode_graphs` as the engine builds with them (turned off where it is on)."""

    enabled: bool
    prefix_cache: bool | None
    decode_graphs: bool | str | None

    @classmethod
    def check(
        cls,
        batch_invariant: Any,
        *,
        prefix_cache: bool | None = None,
        decode_graphs: bool | str | None = None,
        speculative: object = None,
        kv_cache_dtype: str | None = "auto",
        dynamic_rope: bool = False,
        max_seq_len: int | None = None,
        max_position_embeddings: int | None = None,
        key_prefix: str = "",
    ) -> BatchInvariance:
        """The checked setting; a bad value, or one combined with a setting it cannot hold,
        is a ValueError naming `batch_invariant` and that key (each after `key_prefix`).
        `dynamic_rope`: the model's RoPE is dynamic NTK, whose frequencies past
        `max_position_embeddings` follow the step's longest position: refused with a
        `max_seq_len` beyond it (None, the default context, stays within it)."""
        from astrai.inference.cache.kv_dtype import check_kv_cache_dtype  # its package: torch

        k = key_prefix
        if not isinstance(batch_invariant, bool):
            raise ValueError(f"{k}batch_invariant must be true or false, got {batch_invariant!r}")
        if not batch_invariant:
            return cls(False, prefix_cache, decode_graphs)
        refused = (
            (
                prefix_cache is True,
                "prefix_cache=true",
                "cached KV was computed inside another "
                "request's prefill chunk; leave prefix_cache null or false",
            ),
            (speculative is not None, "speculative", "drafts change the rows a step verifies"),
            (
                decode_graphs not in (None, False),
                f"decode_graphs={decode_graphs!r}",
                "captured graphs pad the decode batch; leave decode_graphs null or false",
            ),
            (
                check_kv_cache_dtype(kv_cache_dtype) == "int8",  # as the pool reads it
                "kv_cache_dtype=int8",
                "invariant attention runs torch_native per request, which reads no int8 cache",
            ),
        )
        if dynamic_rope and max_seq_len is not None and max_position_embeddings is not None:
            beyond = max_seq_len > max_position_embeddings
            refused += (
                (
                    beyond,
                    f"max_seq_len={max_seq_len}",
                    "this model's dynamic RoPE past max_position_embeddings="
                    f"{max_position_embeddings} follows the step's longest position",
                ),
            )
        for bad, setting, why in refused:
            if bad:
                raise ValueError(
                    f"{k}batch_invariant=true cannot be combined with {k}{setting}: {why}"
                )
        return cls(True, False, False)

    @classmethod
    def of_engine(
        cls,
        batch_invariant: Any,
        config: ModelConfig,
        prefix_cache: bool | None,
        decode_graphs: bool | str | None,
        speculative: object,
        max_seq_len: int | None,
        kv_cache_dtype: str = "auto",
    ) -> BatchInvariance:
        """The check on `InferenceEngine`'s arguments for a model of `config`."""
        return cls.check(
            batch_invariant,
            prefix_cache=prefix_cache,
            decode_graphs=decode_graphs,
            speculative=speculative,
            kv_cache_dtype=kv_cache_dtype,
            dynamic_rope=(config.rope_scaling or {}).get("rope_type") == "dynamic",
            max_seq_len=max_seq_len,
            max_position_embeddings=config.max_position_embeddings,
        )

    @classmethod
    def of_options(cls, engine: Mapping[str, Any], key_prefix: str = "engine.") -> BatchInvariance:
        """The check on an `engine` config mapping (`conf/engine/`)."""
        return cls.check(
            engine.get("batch_invariant", False),
            prefix_cache=engine.get("prefix_cache"),
            decode_graphs=engine.get("decode_graphs"),
            speculative=engine.get("speculative"),
            kv_cache_dtype=engine.get("kv_cache_dtype"),
            key_prefix=key_prefix,
        )


__all__ = ["BatchInvariance"]
