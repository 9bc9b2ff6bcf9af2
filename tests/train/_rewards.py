"""Test-only rewards, plugged into `python -m astrai.train` runs as `_target_` entries of
`strategy.rewards` with this folder on PYTHONPATH."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


def length_mod3(record: Mapping[str, Any], completion: str) -> float:
    """Varies for a random policy, so its groups have reward variance and the policy moves."""
    return float(len(completion) % 3)


def raises_on_even(record: Mapping[str, Any], completion: str) -> float:
    """Raises on completions of an even length: a reward whose failures a run counts."""
    if len(completion) % 2 == 0:
        raise ValueError(f"even length: {completion!r}")
    return 1.0
