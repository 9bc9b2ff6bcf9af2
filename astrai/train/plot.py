"""Plot a run's curves from its CSV logs: `python -m astrai.train.plot RUN_DIR [--out PNG]`.

`python -m astrai.train.plot sweep MULTIRUN_DIR --param KEY --metric NAME` plots a sweep's
final metric against a swept parameter instead (`astrai.train.sweep_plot`), and
`python -m astrai.train.plot compare RUN_A RUN_B ... --metrics train/loss,val/loss` draws
several runs' curves on shared axes (`astrai.train.compare_plot`).

Reads every `<run>/csv/*/metrics.csv` (one per launch, so a resumed run is one curve), and
draws train/val loss against the optimizer step, plus `val/bpb` (pretraining), any `eval/*`
scores, the learning rate and, with `--metrics a,b`, a panel per named metric. Needs
matplotlib (in the `dev` extra).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path
from typing import Any

from astrai.train.figures import pyplot, save_figure
from astrai.train.logs import read_metrics, run_name, summary

log = logging.getLogger(__name__)


#: eval/<suite>/* bookkeeping that is not a score: kept out of the scores panel
NOT_SCORES = ("/seconds", "/count", "/completion_len")


def _panel(ax: Any, m: dict[str, Any], keys: list[str], style: str, ylabel: str | None) -> None:
    for key in keys:
        xs, ys = zip(*m[key])
        ax.plot(xs, ys, style, label=key, markersize=4)
    ax.set_xlabel("optimizer step")
    if ylabel:
        ax.set_ylabel(ylabel)
    ax.legend()
    ax.grid(alpha=0.3)


def plot(
    run: str | Path,
    out: str | Path,
    title: str | None = None,
    extra: list[str] | None = None,
) -> Path:
    """Loss curves, then `val/bpb`, the `eval/*` scores and the learning rate; `extra`
    metrics (e.g. `train/reward_mean`, `val/rewards/accuracy`) get a panel each."""
    m = read_metrics(run)
    missing = [k for k in extra or [] if k not in m]
    if missing:
        raise KeyError(f"metrics not logged in {run}: {missing} (have: {sorted(m)})")
    evals = sorted(k for k in m if k.startswith("eval/") and not k.endswith(NOT_SCORES))
    lrs = sorted(k for k in m if k.startswith("lr"))
    panels: list[tuple[list[str], str, str | None]] = []  # (metrics, line style, y label)
    if "val/bpb" in m:
        panels.append((["val/bpb"], "o-", "bits per UTF-8 byte"))
    if evals:
        panels.append((evals, "o-", None))
    if lrs:
        panels.append((lrs, "-", "learning rate"))
    panels += [([k], "o-" if len(m[k]) < 40 else "-", None) for k in extra or []]

    plt = pyplot()
    fig, axes = plt.subplots(
        1, 1 + len(panels), figsize=(5.5 * (1 + len(panels)), 4), squeeze=False
    )
    ax = axes[0][0]
    for key, style in (("train/loss", "-"), ("val/loss", "o-")):
        if key in m:
            xs, ys = zip(*m[key])
            ax.plot(xs, ys, style, label=key, markersize=4, alpha=0.9 if "val" in key else 0.6)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("loss")  # nats/token for pretrain and SFT; the objective for DPO and GRPO
    losses = [v for key in ("train/loss", "val/loss") for _, v in m.get(key, []) if v > 0]
    if losses and max(losses) > 100 * min(losses):  # a run that learns its task: log scale
        ax.set_yscale("log")
    ax.legend()
    ax.grid(alpha=0.3)
    for ax, (keys, style, ylabel) in zip(axes[0][1:], panels):
        _panel(ax, m, keys, style, ylabel)
    fig.suptitle(title or run_name(run))  # outputs/latest: the run it points at
    fig.tight_layout()
    return save_figure(fig, out)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["sweep"]:
        from astrai.train.sweep_plot import main as sweep_main

        sweep_main(argv[1:])
        return
    if argv[:1] == ["compare"]:
        from astrai.train.compare_plot import main as compare_main

        compare_main(argv[1:])
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run", help="a run folder (holds csv/)")
    parser.add_argument("--out", default=None, help="PNG path (default: <run>/curves.png)")
    parser.add_argument("--title", default=None)
    parser.add_argument(
        "--metrics", default="", help="comma-separated metrics to add, one panel each"
    )
    args = parser.parse_args(argv)
    extra = [k for k in args.metrics.split(",") if k]
    title = args.title or run_name(args.run)
    out = plot(args.run, args.out or Path(args.run) / "curves.png", title, extra)
    print(json.dumps({"plot": str(out), "title": title, "final": summary(args.run)}, indent=2))


if __name__ == "__main__":
    main()
