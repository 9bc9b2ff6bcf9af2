"""Test-only rewards, plugged into `python -m astrai.train` runs as `_target_` entries of
`strategy.rewards` with this folder on PYTHONPATH."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


def length_mod3(record: Mapping[str, Any], completion: str) -> float:
    """Varies for a random policy, so its groups have reward variance and the policy moves."""
    return float(len(completion) % 3)
