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


class Planted:
    """A reward that flips at a known optimizer step: 0 for every completion before step
    ``flip_at`` (zero advantages: with no KL and no weight decay the weights stay exactly
    the start's), from it the completion's length mod 3, and at step ``flip_at`` the first
    prompt scored gets ``poison`` times that (a planted poisoned rollout group). The step is
    counted from the calls: ``calls_per_step`` = prompts per step x completions per prompt."""

    def __init__(self, flip_at: int, calls_per_step: int, poison: float = 10.0) -> None:
        import threading

        self.flip_at, self.calls_per_step, self.poison = flip_at, calls_per_step, poison
        self.calls = 0
        self.lock = threading.Lock()
        self.poisoned: str | None = None

    def __call__(self, record: Mapping[str, Any], completion: str) -> float:
        with self.lock:
            step = self.calls // self.calls_per_step + 1
            self.calls += 1
            if step < self.flip_at:
                return 0.0
            key = repr(sorted(record.items()))
            if step == self.flip_at and self.poisoned is None:
                self.poisoned = key
            value = float(len(completion) % 3)
            return value * self.poison if step == self.flip_at and key == self.poisoned else value
