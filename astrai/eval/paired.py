"""Paired statistics for comparing two models on the same items.

When models A and B are scored on the same items (and, for sampled suites, with the same
per-request seeds), each item gives a pair ``(a_i, b_i)``. Most of the item-to-item
variation (easy and hard items, lucky and unlucky draws) is shared by both members of a
pair, so the difference ``b_i - a_i`` varies much less than either score, and an interval
built from the differences is narrower than one that treats the two runs as independent
samples (Newcombe's interval, :func:`astrai.eval.intervals.difference_ci`).

* :func:`mcnemar_exact`: McNemar's exact test for 0/1 scores, the two-sided binomial test
  of the discordant pairs (A right and B wrong vs A wrong and B right) against 1/2.
* :func:`paired_bootstrap`: the percentile bootstrap interval of the mean difference,
  resampling items (pairs) with a fixed seed, so the same inputs give the same interval.
* :func:`compare_samples`: both, plus the unpaired interval for 0/1 scores, as one record.

Plain Python and numpy: scipy is not a dependency of the package.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

__all__ = [
    "BOOTSTRAP_RESAMPLES",
    "BOOTSTRAP_SEED",
    "binomial_two_sided",
    "compare_samples",
    "is_binary",
    "mcnemar_exact",
    "paired_bootstrap",
]

BOOTSTRAP_RESAMPLES = 10_000
BOOTSTRAP_SEED = 0
_BLOCK = 1 << 22  # resampled indices held at once (bounds memory for large suites)


def binomial_two_sided(k: int, n: int) -> float:
    """Two-sided exact p-value of `k` successes in `n` fair coin flips,
    ``min(1, 2 P(X <= min(k, n - k)))`` with ``X ~ Bin(n, 1/2)``; 1 when ``n == 0``.

    Summed in exact integers (``sum C(n, j)`` over ``2**n``, divided once with correct
    rounding), so there is no cancellation at small p or large n. For p = 1/2 this is the
    same value as scipy's ``binomtest(k, n).pvalue`` (its two-sided rule adds the outcomes
    no more likely than `k`, which for a symmetric distribution are both tails)."""
    if n < 0 or not 0 <= k <= n:
        raise ValueError(f"binomial_two_sided needs 0 <= k <= n, got k={k} n={n}")
    if n == 0:
        return 1.0
    m = min(k, n - k)
    if 2 * m == n:  # k = n/2: the two tails overlap in the centre, p = 1
        return 1.0
    term, tail = 1, 1  # C(n, 0)
    for j in range(1, m + 1):
        term = term * (n - j + 1) // j
        tail += term
    return min(1.0, (2 * tail) / (1 << n))


def mcnemar_exact(a: Sequence[float], b: Sequence[float]) -> dict[str, Any]:
    """McNemar's exact test of paired 0/1 scores: `b01` items only B got right, `b10` only
    A; under "no difference" each discordant item is a fair coin, so the p-value is the
    two-sided binomial test of `b01` out of ``b01 + b10``."""
    x, y = _pair(a, b)
    if not (is_binary(x) and is_binary(y)):
        raise ValueError("mcnemar_exact needs 0/1 scores")
    only_b = int(np.sum((x == 0) & (y == 1)))
    only_a = int(np.sum((x == 1) & (y == 0)))
    return {
        "only_a": only_a,
        "only_b": only_b,
        "p": binomial_two_sided(only_b, only_a + only_b),
    }


def paired_bootstrap(
    a: Sequence[float],
    b: Sequence[float],
    *,
    resamples: int = BOOTSTRAP_RESAMPLES,
    seed: int = BOOTSTRAP_SEED,
    confidence: float = 0.95,
) -> tuple[float, float]:
    """Percentile bootstrap interval of ``mean(b - a)``: `resamples` times, draw ``n`` item
    indices with replacement (the same for A and B: pairs stay together) and take the
    mean difference; the interval is the central `confidence` of those means. Seeded, so
    deterministic; an all-zero difference gives exactly (0, 0)."""
    x, y = _pair(a, b)
    if resamples < 1 or not 0 < confidence < 1:
        raise ValueError(f"resamples must be >= 1 and confidence in (0, 1), got {resamples}")
    d = y - x
    n = d.size
    if np.all(d == d[0]):  # every resample has the same mean: no randomness to report
        return float(d[0]), float(d[0])
    rng = np.random.default_rng(seed)
    means = np.empty(resamples)
    block = max(1, _BLOCK // n)
    for start in range(0, resamples, block):
        rows = min(block, resamples - start)
        means[start : start + rows] = d[rng.integers(0, n, size=(rows, n))].mean(axis=1)
    alpha = (1 - confidence) / 2
    lo, hi = np.quantile(means, [alpha, 1 - alpha])
    return float(lo), float(hi)


def is_binary(values: Sequence[float] | np.ndarray) -> bool:
    """Every value is 0 or 1 (an accuracy, a pass/fail): the scores McNemar applies to."""
    arr = np.asarray(values, dtype=float)
    return bool(np.all((arr == 0) | (arr == 1)))


def compare_samples(
    a: Sequence[float],
    b: Sequence[float],
    *,
    resamples: int = BOOTSTRAP_RESAMPLES,
    seed: int = BOOTSTRAP_SEED,
) -> dict[str, Any]:
    """Everything the comparison reports for one metric of paired per-item scores.

    ``{kind, n, a, b, diff, sd_diff, ci, ci_method}`` (means of A and B, ``diff = b - a``,
    the paired bootstrap interval); for 0/1 scores (``kind == "binary"``) also McNemar's
    ``p`` with its discordant counts ``only_a`` / ``only_b`` and ``unpaired_ci``, Newcombe's
    interval for two independent proportions of the same size (what ignoring the pairing
    would give)."""
    x, y = _pair(a, b)
    d = y - x
    n = int(d.size)
    out: dict[str, Any] = {
        "kind": "binary" if is_binary(x) and is_binary(y) else "real",
        "n": n,
        "a": float(x.mean()),
        "b": float(y.mean()),
        "diff": float(d.mean()),
        "sd_diff": float(d.std(ddof=1)) if n > 1 else 0.0,
        "ci": list(paired_bootstrap(x, y, resamples=resamples, seed=seed)),
        "ci_method": f"paired percentile bootstrap, {resamples} resamples, seed {seed}",
    }
    if out["kind"] == "binary":
        from astrai.eval.intervals import difference_ci

        out.update(mcnemar_exact(x, y))
        out["unpaired_ci"] = list(difference_ci(out["a"], n, out["b"], n))
    return out


def _pair(a: Sequence[float], b: Sequence[float]) -> tuple[np.ndarray, np.ndarray]:
    x, y = np.asarray(a, dtype=float), np.asarray(b, dtype=float)
    if x.ndim != 1 or x.shape != y.shape:
        raise ValueError(f"paired scores need two equal-length lists, got {x.shape} and {y.shape}")
    if x.size == 0:
        raise ValueError("paired scores: no items")
    if not (np.all(np.isfinite(x)) and np.all(np.isfinite(y))):
        raise ValueError("paired scores must be finite numbers")
    return x, y
