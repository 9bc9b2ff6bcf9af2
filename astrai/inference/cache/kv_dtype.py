"""`kv_cache_dtype` (vLLM's name): what the engine stores K/V in.

`auto` keeps the model's dtype. `int8` stores each token's K and V per KV head as int8 with
one fp32 scale (absmax / 127, computed at write time, so no calibration), a quarter of
fp32's bytes plus 8 bytes per token, layer and KV head; the compiled CPU kernel
(`astrai.extension.backend.cpu_paged`) dequantizes as it reads. It is a CPU-engine option
for fp32 models with per-head K/V (not MLA's latent), and needs that kernel (`make setup`).
Torch-free here, so the command-line checks can call it before anything loads.
"""

from __future__ import annotations

from typing import Any

KV_CACHE_DTYPES = ("auto", "int8")


def check_kv_cache_dtype(value: Any) -> str:
    """The setting as one of `KV_CACHE_DTYPES`; anything else is a ValueError naming the key."""
    if value is None:
        return "auto"
    if not isinstance(value, str) or value.strip().lower() not in KV_CACHE_DTYPES:
        raise ValueError(
            f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {value!r}"
        )
    return value.strip().lower()


__all__ = ["KV_CACHE_DTYPES", "check_kv_cache_dtype"]
