"""The engine's option checks, in one place.

`check_engine_blocks`: the `engine` group's optional blocks (`engine.lora`,
`engine.speculative`), `engine.enable_sleep_mode`, `engine.kv_cache_dtype`,
`engine.quantization`, `engine.scheduling_policy` and `engine.batch_invariant` (with what it
refuses) checked before a command loads its model, by the classes the engine reads them with:
`serve` and `generate` fail in a second with one line naming the key instead of after minutes
of loading. `check_engine_arguments`: the same checks on `InferenceEngine`'s own arguments,
before it allocates anything. Heavy imports stay inside the functions: config paths import
no torch.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from astrai.inference.priority import check_scheduling_policy
from astrai.model.directory import check_model_dir

if TYPE_CHECKING:
    from astrai.inference.batch_invariance import BatchInvariance
    from astrai.inference.speculative import SpeculativeConfig
    from astrai.model.config import ModelConfig


def check_sleep_mode(enabled: Any) -> bool:
    """`enable_sleep_mode` as a bool (`astrai.inference.sleep`); anything else is a ValueError
    naming the key."""
    if not isinstance(enabled, bool):
        raise ValueError(f"enable_sleep_mode must be true or false, got {enabled!r}")
    return enabled


def check_engine_blocks(engine: Mapping[str, Any]) -> SpeculativeConfig | None:
    """Check `engine["lora"]`, `engine["speculative"]` (and a draft model's directory) and
    `engine["enable_sleep_mode"]`, `engine["kv_cache_dtype"]`, `engine["quantization"]`,
    `engine["scheduling_policy"]` and `engine["batch_invariant"]`; a bad one is a SystemExit
    naming the key. Returns the speculative setting (None: off)."""
    from astrai.extension.quantized import check_quantization  # torch: after the preflight
    from astrai.inference.adapters import LoRASettings
    from astrai.inference.batch_invariance import BatchInvariance
    from astrai.inference.cache.kv_dtype import check_kv_cache_dtype
    from astrai.inference.speculative import SpeculativeConfig

    try:
        check_sleep_mode(engine.get("enable_sleep_mode", False))
        check_kv_cache_dtype(engine.get("kv_cache_dtype", "auto"))
        check_scheduling_policy(engine.get("scheduling_policy", "fcfs"))
    except ValueError as err:
        raise SystemExit(f"engine.{err}") from None
    try:
        check_quantization(engine.get("quantization"))  # the message names engine.quantization
    except ValueError as err:
        raise SystemExit(str(err)) from None
    try:
        LoRASettings.of(engine.get("lora"))
        spec = SpeculativeConfig.of(engine.get("speculative"))
        BatchInvariance.of_options(engine)  # names engine.batch_invariant and the other key
    except (TypeError, ValueError) as err:  # the messages name engine.lora / engine.speculative
        raise SystemExit(str(err)) from None
    if spec is not None and spec.model:
        check_model_dir(spec.model, key="engine.speculative.model")
    return spec


@dataclass(frozen=True)
class EngineArguments:
    """`InferenceEngine`'s arguments as checked: `quantization` normalised (an alias
    resolved), what batch invariance resolves (`BatchInvariance`), the scheduling policy."""

    quantization: str | None
    invariance: BatchInvariance
    scheduling_policy: str


def check_engine_arguments(
    config: ModelConfig,
    *,
    enable_sleep_mode: Any,
    quantization: Any,
    scheduling_policy: Any,
    batch_invariant: Any,
    prefix_cache: bool | None,
    decode_graphs: bool | str | None,
    speculative: object,
    max_seq_len: int | None,
    kv_cache_dtype: str,
) -> EngineArguments:
    """`InferenceEngine`'s option checks for a model of `config`, before anything is
    allocated; a bad one is a ValueError naming the parameter."""
    from astrai.extension.quantized import check_quantization  # torch: the engine has it
    from astrai.inference.batch_invariance import BatchInvariance

    check_sleep_mode(enable_sleep_mode)
    quant = check_quantization(quantization)
    policy = check_scheduling_policy(scheduling_policy)
    invariance = BatchInvariance.of_engine(
        batch_invariant,
        config,
        prefix_cache,
        decode_graphs,
        speculative,
        max_seq_len,
        kv_cache_dtype,
    )
    return EngineArguments(quant, invariance, policy)
