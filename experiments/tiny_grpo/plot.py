"""Plot logged metrics of a run folder (its CSV logs) into one PNG, one panel per metric.

    python experiments/tiny_grpo/plot.py outputs/tiny_grpo/<run> experiments/tiny_grpo/curves.png \
        train/reward_mean eval/exact_match train/kl
"""

from __future__ import annotations

import csv
import sys
from collections import defaultdict
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt


def read_metrics(run: Path) -> dict[str, list[tuple[int, float]]]:
    series: dict[str, list[tuple[int, float]]] = defaultdict(list)
    for f in sorted(run.glob("csv/**/metrics.csv")):
        with open(f) as fh:
            for row in csv.DictReader(fh):
                step = int(float(row["step"]))
                for key, value in row.items():
                    if key not in ("step", "epoch") and value:
                        series[key].append((step, float(value)))
    return series


def main(run: str, out: str, *keys: str) -> None:
    series = read_metrics(Path(run))
    keys = keys or tuple(sorted(series))
    cols = min(4, len(keys))
    rows = -(-len(keys) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4 * cols, 3.2 * rows), squeeze=False)
    for ax in axes.flat[len(keys) :]:
        ax.axis("off")
    for ax, key in zip(axes.flat, keys):
        points = series.get(key, [])
        if points:
            xs, ys = zip(*points)
            ax.plot(xs, ys, marker="." if len(xs) < 30 else None)
        ax.set_title(key)
        ax.set_xlabel("optimizer step")
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out, dpi=110)


if __name__ == "__main__":
    main(*sys.argv[1:])
