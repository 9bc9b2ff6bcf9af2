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
