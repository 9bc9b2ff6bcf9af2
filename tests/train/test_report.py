"""Confidence intervals of the reference runs' accuracies (astrai.train.report)."""

from __future__ import annotations

import csv
import math

import pytest

from astrai.eval.intervals import Z95, difference_ci, wilson_interval
from astrai.train.report import main


def _score_test_bounds(k: int, n: int) -> tuple[float, float]:
    """The Wilson interval by definition: the p the score test does not reject, |k/n - p| <=
    z * sqrt(p (1 - p) / n), found by bisection on each side of k/n."""
    phat = k / n

    def inside(p: float) -> bool:
        return abs(phat - p) <= Z95 * math.sqrt(p * (1 - p) / n)

    def edge(lo: float, hi: float) -> float:  # lo outside, hi inside (or the reverse)
        for _ in range(200):
            mid = (lo + hi) / 2
            if inside(mid) == inside(hi):
                hi = mid
            else:
                lo = mid
        return (lo + hi) / 2

    lower = 0.0 if inside(0.0) or k == 0 else edge(0.0, phat)
    upper = 1.0 if inside(1.0) or k == n else edge(1.0, phat)
    return lower, upper


@pytest.mark.parametrize(("k", "n"), [(0, 10), (3, 10), (128, 256), (250, 256), (256, 256)])
def test_wilson_interval_inverts_the_score_test(k, n):
    lo, hi = wilson_interval(k, n)
    ref_lo, ref_hi = _score_test_bounds(k, n)
    assert lo == pytest.approx(ref_lo, abs=1e-9)
    assert hi == pytest.approx(ref_hi, abs=1e-9)
    assert lo <= k / n <= hi


def test_difference_interval_brackets_the_difference_and_is_wider_than_either():
    lo, hi = difference_ci(0.40, 256, 0.60, 256)
    assert lo < 0.20 < hi
    w1 = wilson_interval(0.4 * 256, 256)
    assert hi - lo > w1[1] - w1[0]
    assert difference_ci(0.5, 256, 0.5, 256)[0] < 0 < difference_ci(0.5, 256, 0.5, 256)[1]


def test_bad_counts_are_refused():
    with pytest.raises(ValueError, match="n must be"):
        wilson_interval(0, 0)
    with pytest.raises(ValueError, match="successes"):
        wilson_interval(11, 10)


def test_report_cli_reads_the_run(tmp_path, capsys):
    run = tmp_path / "run"
    (run / "csv" / "v0").mkdir(parents=True)
    em, count = "eval/arithmetic/exact_match", "eval/arithmetic/count"
    with open(run / "csv" / "v0" / "metrics.csv", "w", newline="") as fh:
        w = csv.DictWriter(fh, ["step", em, count, "val/rewards/accuracy"])
        w.writeheader()
        w.writerow({"step": 0, em: 0.25, count: 100, "val/rewards/accuracy": 0.5})
        w.writerow({"step": 10, em: 0.75, count: 100, "val/rewards/accuracy": 0.95})
    assert (
        main(
            [
                str(run),
                "--metric",
                em,
                "--metric",
                "val/rewards/accuracy",
                "--n",
                "val/rewards/accuracy=40",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "| eval/arithmetic/exact_match | 100 | 0.250 [" in out and "(25/100) (0)" in out
    assert "0.750 [" in out and "(75/100) (10)" in out and "+0.500 [" in out
    assert "| val/rewards/accuracy | 40 |" in out and "(38/40)" in out
    with pytest.raises(SystemExit):
        main([str(run), "--metric", "val/rewards/accuracy"])  # no count known
