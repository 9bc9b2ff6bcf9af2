"""The statistics of twin runs: paired per-step differences and their intervals.

Training steps are not independent draws: the loss at step k is close to the loss at step
k+1. The intervals therefore resample *blocks* of consecutive steps (the moving-block
bootstrap, Kunsch 1989; block length n^(1/3), its usual rate), 10,000 resamples, seed 0
(deterministic), percentile 95% intervals. The paired interval resamples the per-step
differences d_k = treatment_k - control_k of twins (the same blocks for both arms); the
unpaired one resamples each arm's steps on its own, which is all two independent runs allow.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

__all__ = ["Effect", "block_means", "paired_effect", "unpaired_effect"]

RESAMPLES = 10_000


@dataclass(frozen=True)
class Effect:
    """The mean difference treatment - control over ``n`` steps with a 95% interval."""

    mean: float
    low: float
    high: float
    n: int

    @property
    def width(self) -> float:
        return self.high - self.low

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def __str__(self) -> str:
        return f"{self.mean:+.4g} [{self.low:+.4g}, {self.high:+.4g}]"


def block_length(n: int) -> int:
    return max(1, round(n ** (1 / 3)))


def block_means(x: np.ndarray, rng: np.random.Generator, resamples: int) -> np.ndarray:
    """``resamples`` moving-block bootstrap means of the series ``x`` (blocks of
    `block_length`, start points drawn uniformly, the series' length kept)."""
    n = len(x)
    b = block_length(n)
    blocks = math.ceil(n / b)
    starts = rng.integers(0, n - b + 1, size=(resamples, blocks))
    index = (starts[:, :, None] + np.arange(b)[None, None, :]).reshape(resamples, -1)[:, :n]
    return x[index].mean(axis=1)


def _effect(mean: float, draws: np.ndarray, n: int) -> Effect:
    low, high = np.percentile(draws, [2.5, 97.5])
    return Effect(float(mean), float(low), float(high), n)


def _series(control: Sequence[float], treatment: Sequence[float]) -> tuple[np.ndarray, np.ndarray]:
    c, t = np.asarray(control, dtype=np.float64), np.asarray(treatment, dtype=np.float64)
    if len(c) != len(t) or len(c) == 0:
        raise ValueError(f"need two equally long, non-empty series: got {len(c)} and {len(t)}")
    return c, t


def paired_effect(control: Sequence[float], treatment: Sequence[float], seed: int = 0) -> Effect:
    """Twins: the mean of d_k = treatment_k - control_k with its block-bootstrap interval."""
    c, t = _series(control, treatment)
    d = t - c
    if not d.any():
        return Effect(0.0, 0.0, 0.0, len(d))
    draws = block_means(d, np.random.default_rng(seed), RESAMPLES)
    return _effect(float(d.mean()), draws, len(d))


def unpaired_effect(control: Sequence[float], treatment: Sequence[float], seed: int = 0) -> Effect:
    """Two independent runs: mean(treatment) - mean(control), each arm resampled on its own."""
    c, t = _series(control, treatment)
    rng = np.random.default_rng(seed)
    draws = block_means(t, rng, RESAMPLES) - block_means(c, rng, RESAMPLES)
    return _effect(float(t.mean() - c.mean()), draws, len(c))
