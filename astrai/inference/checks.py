"""Range checks of request parameters, shared by the parameter classes."""

from __future__ import annotations

import math
from numbers import Real


def check_number(name: str, value: object, low: float, high: float, *, low_open: bool = False):
    """ValueError naming `name` unless `value` is a finite real in [low, high] ((low, high]
    with `low_open`); bools are not numbers here."""
    if isinstance(value, bool) or not isinstance(value, Real) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    if value > high or value < low or (low_open and value == low):
        bracket = "(" if low_open else "["
        raise ValueError(f"{name} must be in {bracket}{low:g}, {high:g}], got {value!r}")


# What a prompt + max_tokens beyond the model's context does (`SamplingParams`):
# "clamp" generates until the context is full (finish reason length), "error" rejects the
# request at submission, naming both numbers (OpenAI's and vLLM's rule for their APIs).
MAX_TOKENS_POLICIES = ("clamp", "error")


def check_choice(name: str, value: object, choices: tuple[str, ...]) -> str:
    """`value` if it is one of `choices`; otherwise a ValueError naming `name`."""
    if not isinstance(value, str) or value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(choices)}; got {value!r}")
    return value
