"""A run's start and end figures with 95% confidence intervals, as a markdown table.

    python -m astrai.train.report RUN_DIR [--metric eval/arithmetic/exact_match ...] [--n val/rewards/accuracy=480]

An accuracy measured on ``n`` problems is a binomial proportion; the Wilson score interval
(Wilson 1927) stays inside [0, 1] and is accurate at the small ``n`` and extreme rates of
our reference runs, where the normal approximation is not. ``n`` for an ``eval/<suite>/*``
metric is the ``eval/<suite>/count`` the evaluation callback logged with it (the items the
suite scored); give any other with ``--n METRIC=COUNT``.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

from astrai.eval.intervals import difference_ci, wilson_interval
from astrai.train.logs import read_metrics

__all__ = ["markdown_table"]


def _fmt(p: float, n: int) -> str:
    lo, hi = wilson_interval(round(p * n), n)
    return f"{p:.3f} [{lo:.3f}, {hi:.3f}] ({round(p * n)}/{n})"


def markdown_table(
    series: Mapping[str, Sequence[tuple[int, float]]], counts: Mapping[str, int]
) -> str:
    """Start, end and change (each with its 95% interval) of every metric in ``counts``."""
    lines = [
        "| metric | n | start (step) | end (step) | change [95% CI] |",
        "| --- | --- | --- | --- | --- |",
    ]
    for metric, n in counts.items():
        points = series.get(metric)
        if not points:
            raise KeyError(f"metric {metric!r} was not logged (have: {sorted(series)})")
        (s0, p0), (s1, p1) = points[0], points[-1]
        lo, hi = difference_ci(p0, n, p1, n)
        lines.append(
            f"| {metric} | {n} | {_fmt(p0, n)} ({s0}) | {_fmt(p1, n)} ({s1}) | "
            f"{p1 - p0:+.3f} [{lo:+.3f}, {hi:+.3f}] |"
        )
    return "\n".join(lines)


def _eval_count(series: Mapping[str, Sequence[tuple[int, float]]], metric: str) -> int | None:
    """The item count logged next to an ``eval/<suite>/<metric>`` (its last value)."""
    suite, _, _ = metric.rpartition("/")
    points = series.get(f"{suite}/count") if metric.startswith("eval/") and suite else None
    return int(points[-1][1]) if points else None


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("run", type=Path, help="a run folder (with csv/ and .hydra/)")
    parser.add_argument("--metric", action="append", default=None, help="an accuracy to report")
    parser.add_argument("--n", action="append", default=[], help="METRIC=COUNT")
    args = parser.parse_args(argv)
    series = read_metrics(args.run)
    counts: dict[str, int] = {}
    for item in args.n:
        key, sep, value = item.partition("=")
        if not sep or not value.isdigit():
            parser.error(f"--n takes METRIC=COUNT, got {item!r}")
        counts[key] = int(value)
    ordered: dict[str, int] = {}  # the order of --metric
    for metric in args.metric or [m for m in series if m.endswith("/exact_match")]:
        if metric not in counts:
            eval_n = _eval_count(series, metric)
            if eval_n is None:
                parser.error(f"--n {metric}=COUNT is needed (no count known for it)")
            counts[metric] = eval_n
        ordered[metric] = counts[metric]
    print(markdown_table(series, ordered))
    return 0


if __name__ == "__main__":
    sys.exit(main())
