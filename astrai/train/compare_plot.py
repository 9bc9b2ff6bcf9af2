"""Several runs' curves on shared axes: `python -m astrai.train.plot compare RUN ... --metrics`.

One panel per metric, one line per run that logged it (labelled by `--labels` or the run's
folder), so an
ablation (a MoE model against a dense one of the same active size, two learning rates) reads
at a glance. The final value of each metric per run is printed as JSON and written as a
markdown table beside the PNG.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from pathlib import Path

from astrai.train.figures import pyplot, save_figure
from astrai.train.logs import read_metrics, run_name


def compare(
    runs: Sequence[str | Path],
    metrics: Sequence[str],
    out: str | Path,
    labels: Sequence[str] | None = None,
    title: str | None = None,
) -> dict[str, dict[str, float]]:
    """Plot `metrics` of every run in `runs`; return `{label: {metric: final value}}`."""
    if not runs or not metrics:
        raise ValueError("compare: give at least one run and one metric")
    labels = list(labels) if labels else [run_name(r) for r in runs]
    if len(labels) != len(runs):
        raise ValueError(f"compare: {len(labels)} labels for {len(runs)} runs")
    logged = [read_metrics(r) for r in runs]
    nowhere = [k for k in metrics if not any(k in m for m in logged)]
    if nowhere:
        have = sorted({k for m in logged for k in m})
        raise KeyError(f"metrics not logged in any of {list(runs)}: {nowhere} (have: {have})")
    plt = pyplot()
    fig, axes = plt.subplots(1, len(metrics), figsize=(5.5 * len(metrics), 4), squeeze=False)
    finals: dict[str, dict[str, float]] = {label: {} for label in labels}
    for ax, key in zip(axes[0], metrics):
        for label, m in zip(labels, logged):
            if key not in m:  # e.g. router statistics of the MoE run only
                continue
            xs, ys = zip(*m[key])
            ax.plot(xs, ys, "o-" if len(xs) < 40 else "-", label=label, markersize=4, alpha=0.8)
            finals[label][key] = ys[-1]
        ax.set_xlabel("optimizer step")
        ax.set_ylabel(key)
        ax.legend()
        ax.grid(alpha=0.3)
    fig.suptitle(title or " vs ".join(labels))
    fig.tight_layout()
    path = save_figure(fig, out)
    rows = ["| run | " + " | ".join(metrics) + " |", "| --- |" + " --- |" * len(metrics)]
    rows += [
        f"| {label} | " + " | ".join(f"{v[k]:.4f}" if k in v else "-" for k in metrics) + " |"
        for label, v in finals.items()
    ]
    path.with_suffix(".md").write_text("\n".join(rows) + "\n")
    return finals


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", help="run folders (each holds csv/)")
    parser.add_argument("--metrics", required=True, help="comma-separated metrics, one panel each")
    parser.add_argument("--labels", default="", help="comma-separated run labels")
    parser.add_argument("--out", required=True, help="PNG path (a .md table is written beside)")
    parser.add_argument("--title", default=None)
    args = parser.parse_args(argv)
    labels = [x for x in args.labels.split(",") if x] or None
    metrics = [x for x in args.metrics.split(",") if x]
    finals = compare(args.runs, metrics, args.out, labels, args.title)
    print(json.dumps({"plot": args.out, "final": finals}, indent=2))
