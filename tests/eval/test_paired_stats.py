"""Paired statistics (astrai.eval.paired) against independent references: scipy's binomial
test where installed and, always, the binomial distribution enumerated with exact fractions;
the bootstrap against the normal-theory interval of a paired mean."""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np
import pytest

from astrai.eval.paired import (
    binomial_two_sided,
    compare_samples,
    is_binary,
    mcnemar_exact,
    paired_bootstrap,
)
from astrai.train.report import difference_ci


def reference_p(k: int, n: int) -> float:
    """Two-sided exact binomial p at 1/2 by its definition (scipy's rule): the total
    probability of every outcome no more likely than the one observed, in exact fractions."""
    if n == 0:
        return 1.0
    pmf = [Fraction(math.comb(n, j), 2**n) for j in range(n + 1)]
    return float(min(Fraction(1), sum(q for q in pmf if q <= pmf[k])))


def paired_scores(both: int, only_a: int, only_b: int, neither: int, seed: int = 0):
    """0/1 scores of A and B over shuffled items with the given agreement counts."""
    a = [1] * both + [1] * only_a + [0] * only_b + [0] * neither
    b = [1] * both + [0] * only_a + [1] * only_b + [0] * neither
    order = np.random.default_rng(seed).permutation(len(a))
    return [a[i] for i in order], [b[i] for i in order]


COUNTS = [(0, 0), (0, 1), (1, 0), (3, 3), (0, 7), (2, 9), (12, 5), (40, 61), (150, 200)]


@pytest.mark.parametrize("only_a,only_b", COUNTS)
def test_mcnemar_matches_the_enumerated_binomial(only_a, only_b):
    a, b = paired_scores(20, only_a, only_b, 30)
    got = mcnemar_exact(a, b)
    assert (got["only_a"], got["only_b"]) == (only_a, only_b)
    assert got["p"] == pytest.approx(reference_p(only_b, only_a + only_b), rel=1e-12, abs=0)


@pytest.mark.parametrize("only_a,only_b", COUNTS)
def test_mcnemar_matches_scipy_binomtest(only_a, only_b):
    stats = pytest.importorskip("scipy.stats")
    a, b = paired_scores(5, only_a, only_b, 5)
    n = only_a + only_b
    want = stats.binomtest(only_b, n, 0.5).pvalue if n else 1.0
    assert mcnemar_exact(a, b)["p"] == pytest.approx(want, rel=1e-9, abs=0)


def test_binomial_tail_stays_exact_far_out():
    # 2 P(X <= 10), X ~ Bin(1000, 1/2), is about 5e-278: no cancellation, no underflow
    k, n = 10, 1000
    got = binomial_two_sided(k, n)
    assert 0 < got < 1e-270
    assert got == pytest.approx(reference_p(k, n), rel=1e-12)
    assert binomial_two_sided(n - k, n) == got
    with pytest.raises(ValueError, match="0 <= k <= n"):
        binomial_two_sided(5, 4)


def test_bootstrap_is_deterministic_and_close_to_the_normal_interval():
    rng = np.random.default_rng(7)
    a = rng.normal(size=400)
    b = a + 0.1 + rng.normal(scale=0.5, size=400)  # correlated with a, shifted
    first, again = paired_bootstrap(a, b), paired_bootstrap(a, b)
    assert first == again
    other_seed = paired_bootstrap(a, b, seed=1)
    assert other_seed != first
    d = b - a
    lo, hi = first
    assert lo < d.mean() < hi
    half = 1.959963984540054 * d.std(ddof=1) / math.sqrt(d.size)  # normal theory
    assert lo == pytest.approx(d.mean() - half, abs=0.1 * half)
    assert hi == pytest.approx(d.mean() + half, abs=0.1 * half)
    assert other_seed[0] == pytest.approx(lo, abs=0.1 * half)


def test_identical_scores_give_zero_and_p_one():
    a, _ = paired_scores(30, 5, 7, 40)
    s = compare_samples(a, a)
    assert s["kind"] == "binary" and s["diff"] == 0.0 and s["ci"] == [0.0, 0.0]
    assert s["p"] == 1.0 and s["only_a"] == s["only_b"] == 0
    lo, hi = s["unpaired_ci"]  # ignoring the pairing, the same data leave room either way
    assert lo < -0.05 and hi > 0.05
    real = compare_samples([0.5, 1.5, 2.5], [0.5, 1.5, 2.5])
    assert real["kind"] == "real" and real["ci"] == [0.0, 0.0] and "p" not in real


def test_binary_comparison_record():
    a, b = paired_scores(50, 4, 16, 30)
    s = compare_samples(a, b)
    n = 100
    assert s["n"] == n and s["a"] == 0.54 and s["b"] == 0.66
    assert s["diff"] == pytest.approx(0.12)
    assert s["unpaired_ci"] == list(difference_ci(0.54, n, 0.66, n))
    assert s["p"] == pytest.approx(reference_p(16, 20), rel=1e-12)
    lo, hi = s["ci"]
    assert lo < s["diff"] < hi
    # 20 discordant items out of 100 vary the difference far less than two free proportions
    assert hi - lo < 0.7 * (s["unpaired_ci"][1] - s["unpaired_ci"][0])
    assert "bootstrap" in s["ci_method"]


def test_real_valued_comparison_has_no_test_of_proportions():
    rng = np.random.default_rng(3)
    a = rng.normal(2.0, 0.3, size=50)
    b = a - 0.05 + rng.normal(0, 0.02, size=50)
    s = compare_samples(a, b)
    assert s["kind"] == "real" and s["n"] == 50
    assert s["diff"] == pytest.approx(float(np.mean(b - a)))
    assert s["sd_diff"] == pytest.approx(float(np.std(b - a, ddof=1)))
    assert s["ci"][0] < s["diff"] < s["ci"][1] < 0
    assert "p" not in s and "unpaired_ci" not in s


def test_pass_at_k_fractions_are_real_valued():
    assert is_binary([0, 1, 1.0, 0.0]) and not is_binary([0, 0.5, 1])
    assert compare_samples([0.0, 0.5, 1.0], [0.5, 0.5, 1.0])["kind"] == "real"
    with pytest.raises(ValueError, match="0/1"):
        mcnemar_exact([0.0, 0.5], [1.0, 1.0])


@pytest.mark.parametrize(
    "a,b,message",
    [
        ([1, 0], [1], "equal-length"),
        ([], [], "no items"),
        ([1.0, float("nan")], [1.0, 1.0], "finite"),
    ],
)
def test_bad_scores_are_named(a, b, message):
    with pytest.raises(ValueError, match=message):
        compare_samples(a, b)
