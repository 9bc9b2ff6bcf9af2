"""The JSON form of what trainer and replica exchange: `SamplingParams` on `/generate`
and tensor dtypes on the weight-update routes. One home, so the client
(`astrai.remote.client`) and the replica's routes (`astrai.serve.rl_routes`) cannot
disagree. Torch-free."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from astrai.inference.params import SamplingParams

# The fields a JSON body may set (the others are Python objects: logits processors,
# structured outputs; the seed travels at the top level; prompt log-probs are not returned).
WIRE_FIELDS = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "presence_penalty",
    "frequency_penalty",
    "logit_bias",
    "max_tokens",
    "max_tokens_policy",
    "ignore_eos",
    "stop_ids",
    "logprobs_mode",
    "n",
    "adapter",
)
# SGLang's (and vLLM's) names for astrai's fields
ALIASES = {"stop_token_ids": "stop_ids", "max_new_tokens": "max_tokens"}
_DEFAULTS = SamplingParams()


def params_to_json(params: SamplingParams) -> dict[str, Any]:
    """The fields of `params` that differ from the defaults, as JSON values; a ValueError
    naming a field that cannot travel (a logits processor, a structured output, a seed:
    `generate`'s own argument)."""
    out: dict[str, Any] = {}
    for f in dataclasses.fields(SamplingParams):
        value = getattr(params, f.name)
        if value == getattr(_DEFAULTS, f.name):
            continue
        if f.name not in WIRE_FIELDS:
            raise ValueError(f"{f.name}: cannot be sent to a replica (set it to its default)")
        if f.name == "stop_ids":
            value = sorted(value)
        elif f.name == "logit_bias":
            value = {str(k): v for k, v in value.items()}
        out[f.name] = value
    return out


def params_from_json(data: Mapping[str, Any], *, seed: int | None) -> SamplingParams:
    """`SamplingParams` from a body's `sampling_params` and top-level `seed`, checked
    (`SamplingParams.validate`); a ValueError whose message starts with the bad field."""
    fields: dict[str, Any] = {}
    for key, value in data.items():
        name = ALIASES.get(key, key)
        if name not in WIRE_FIELDS:
            hint = " (give it at the top level)" if name == "seed" else ""
            raise ValueError(
                f"sampling_params.{key} is not a field /generate takes{hint}; "
                f"expected some of {', '.join(WIRE_FIELDS)}"
            )
        if name in fields:
            raise ValueError(f"sampling_params.{key} is given twice (under two names)")
        if name == "stop_ids" and isinstance(value, list):
            value = frozenset(value) if all(isinstance(v, int) for v in value) else value
        elif name == "logit_bias" and isinstance(value, Mapping):
            value = {_token(k): v for k, v in value.items()}
        fields[name] = value
    params = SamplingParams(**fields, seed=seed)
    try:
        return params.validate()
    except ValueError as err:
        raise ValueError(f"sampling_params.{err}") from None


def _token(key: object) -> object:
    """A JSON object key as a token id (JSON keys are strings); left as is when not one."""
    if isinstance(key, str) and key.isdigit():
        return int(key)
    return key


def dtype_name(dtype: Any) -> str:
    """`torch.float32` -> ``"float32"`` (the name on the wire)."""
    return str(dtype).removeprefix("torch.")
