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
batch sizes pad the decode batch; `null` resolves to eager), `lora` (the adapters' products
group tokens by adapter across requests).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any


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
        lora: object = None,
        key_prefix: str = "",
    ) -> BatchInvariance:
        """The checked setting; a bad value, or one combined with a setting it cannot hold,
        is a ValueError naming `batch_invariant` and that key (each after `key_prefix`)."""
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
            (lora is not None, "lora", "adapter products group tokens across requests"),
        )
        for bad, setting, why in refused:
            if bad:
                raise ValueError(
                    f"{k}batch_invariant=true cannot be combined with {k}{setting}: {why}"
                )
        return cls(True, False, False)

    @classmethod
    def of_options(cls, engine: Mapping[str, Any], key_prefix: str = "engine.") -> BatchInvariance:
        """The check on an `engine` config mapping (`conf/engine/`)."""
        return cls.check(
            engine.get("batch_invariant", False),
            prefix_cache=engine.get("prefix_cache"),
            decode_graphs=engine.get("decode_graphs"),
            speculative=engine.get("speculative"),
            lora=engine.get("lora"),
            key_prefix=key_prefix,
        )


__all__ = ["BatchInvariance"]
