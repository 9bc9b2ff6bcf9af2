"""Plot a run's curves from its CSV logs: `python -m astrai.train.plot RUN_DIR [--out PNG]`.

Reads every `<run>/csv/*/metrics.csv` (one per launch, so a resumed run is one curve), and
draws train/val loss against the optimizer step, plus any `eval/*` metrics and the learning
rate. Needs matplotlib (in the `dev` extra).
"""

from __future__ import annotations

import argparse
import csv
import json
import logging
from collections import defaultdict
from pathlib import Path

log = logging.getLogger(__name__)


def read_metrics(run: str | Path) -> dict[str, list[tuple[int, float]]]:
    """`{metric: [(step, value), ...]}` over all CSV logs of a run, sorted by step, with the
    value of a later launch winning for a step logged twice (a resumed run)."""
    run = Path(run)
    files = sorted((run / "csv").glob("**/metrics.csv"), key=lambda p: p.stat().st_mtime)
    if not files:
        raise FileNotFoundError(f"no csv/**/metrics.csv under {run}")
    series: dict[str, dict[int, float]] = defaultdict(dict)
    for f in files:
        with open(f) as fh:
            for row in csv.DictReader(fh):
                if not row.get("step"):
                    continue
                step = int(float(row["step"]))
                for key, value in row.items():
                    if key in ("step", "epoch") or value in (None, ""):
                        continue
                    series[key][step] = float(value)
    return {k: sorted(v.items()) for k, v in series.items()}


def summary(run: str | Path) -> dict[str, float]:
    """The last value of every metric (the final metrics of a run)."""
    return {k: v[-1][1] for k, v in read_metrics(run).items() if v}


def plot(run: str | Path, out: str | Path, title: str | None = None) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    m = read_metrics(run)
    evals = sorted(k for k in m if k.startswith("eval/"))
    lrs = sorted(k for k in m if k.startswith("lr"))
    panels = 1 + bool(evals) + bool(lrs)
    fig, axes = plt.subplots(1, panels, figsize=(5.5 * panels, 4), squeeze=False)
    ax = axes[0][0]
    for key, style in (("train/loss", "-"), ("val/loss", "o-")):
        if key in m:
            xs, ys = zip(*m[key])
            ax.plot(xs, ys, style, label=key, markersize=4, alpha=0.9 if "val" in key else 0.6)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("loss (nats/token)")
    ax.legend()
    ax.grid(alpha=0.3)
    i = 1
    if evals:
        ax = axes[0][i]
        for key in evals:
            xs, ys = zip(*m[key])
            ax.plot(xs, ys, "o-", label=key, markersize=4)
        ax.set_xlabel("optimizer step")
        ax.legend()
        ax.grid(alpha=0.3)
        i += 1
    if lrs:
        ax = axes[0][i]
        for key in lrs:
            xs, ys = zip(*m[key])
            ax.plot(xs, ys, label=key)
        ax.set_xlabel("optimizer step")
        ax.set_ylabel("learning rate")
        ax.legend()
        ax.grid(alpha=0.3)
    fig.suptitle(title or Path(run).name)
    fig.tight_layout()
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run", help="a run folder (holds csv/)")
    parser.add_argument("--out", default=None, help="PNG path (default: <run>/curves.png)")
    parser.add_argument("--title", default=None)
    args = parser.parse_args()
    out = plot(args.run, args.out or Path(args.run) / "curves.png", args.title)
    print(json.dumps({"plot": str(out), "final": summary(args.run)}, indent=2))


if __name__ == "__main__":
    main()
