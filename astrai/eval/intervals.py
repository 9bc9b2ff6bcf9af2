"""95% intervals of proportions: Wilson's score interval and Newcombe's interval of a difference.

An accuracy measured on ``n`` problems is a binomial proportion; the Wilson score interval
(Wilson 1927) stays inside [0, 1] and is accurate at the small ``n`` and extreme rates of
our reference runs, where the normal approximation is not. Used by the run report
(`astrai.train.report`), the preference suites and `astrai.eval compare` (the unpaired
interval next to the paired one).
"""

from __future__ import annotations

import math

__all__ = ["Z95", "difference_ci", "wilson_interval"]

Z95 = 1.959963984540054


def wilson_interval(successes: float, n: int, z: float = Z95) -> tuple[float, float]:
    """The Wilson score interval of a binomial proportion ``successes / n``."""
    if n <= 0:
        raise ValueError(f"wilson_interval: n must be > 0, got {n}")
    if not 0 <= successes <= n:
        raise ValueError(f"wilson_interval: successes must be in [0, n], got {successes} of {n}")
    if successes == n:  # exactly: the closed form loses the last ulp
        return (n / (n + z * z), 1.0)
    if successes == 0:
        return (0.0, (z * z) / (n + z * z))
    p = successes / n
    denom = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
    return max(0.0, centre - half), min(1.0, centre + half)


def difference_ci(p1: float, n1: int, p2: float, n2: int, z: float = Z95) -> tuple[float, float]:
    """A 95% interval of ``p2 - p1`` for two independent proportions (Newcombe's method 10,
    built from the two Wilson intervals)."""
    l1, u1 = wilson_interval(p1 * n1, n1, z)
    l2, u2 = wilson_interval(p2 * n2, n2, z)
    d = p2 - p1
    lower = d - math.sqrt((p2 - l2) ** 2 + (u1 - p1) ** 2)
    upper = d + math.sqrt((u2 - p2) ** 2 + (p1 - l1) ** 2)
    return lower, upper
