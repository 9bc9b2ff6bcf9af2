"""Plot a run's curves from its CSV logs: `python -m astrai.train.plot RUN_DIR [--out PNG]`.

`python -m astrai.train.plot sweep MULTIRUN_DIR --param KEY --metric NAME` plots a sweep's
final metric against a swept parameter instead (`astrai.train.sweep_plot`).

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

from astrai.train.logs import read_metrics, summary

log = logging.getLogger(__name__)


#: eval/* bookkeeping that is not a score: kept out of the scores panel
NOT_SCORES = ("eval/seconds", "eval/completion_len")


def plot(
    run: str | Path,
    out: str | Path,
    title: str | None = None,
    extra: list[str] | None = None,
) -> Path:
    """Loss curves, then `val/bpb`, the `eval/*` scores and the learning rate; `extra`
    metrics (e.g. `train/reward_mean`, `val/rewards/accuracy`) get a panel each."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    m = read_metrics(run)
    missing = [k for k in extra or [] if k not in m]
    if missing:
        raise KeyError(f"metrics not logged in {run}: {missing} (have: {sorted(m)})")
    evals = sorted(k for k in m if k.startswith("eval/") and k not in NOT_SCORES)
    lrs = sorted(k for k in m if k.startswith("lr"))
    bpb = "val/bpb" in m
    panels = 1 + bpb + bool(evals) + bool(lrs) + len(extra or [])
    fig, axes = plt.subplots(1, panels, figsize=(5.5 * panels, 4), squeeze=False)
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
    i = 1
    if bpb:
        ax = axes[0][i]
        xs, ys = zip(*m["val/bpb"])
        ax.plot(xs, ys, "o-", label="val/bpb", markersize=4)
        ax.set_xlabel("optimizer step")
        ax.set_ylabel("bits per UTF-8 byte")
        ax.legend()
        ax.grid(alpha=0.3)
        i += 1
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
        i += 1
    for key in extra or []:
        ax = axes[0][i]
        xs, ys = zip(*m[key])
        ax.plot(xs, ys, "o-" if len(xs) < 40 else "-", label=key, markersize=4)
        ax.set_xlabel("optimizer step")
        ax.legend()
        ax.grid(alpha=0.3)
        i += 1
    fig.suptitle(title or Path(run).name)
    fig.tight_layout()
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["sweep"]:
        from astrai.train.sweep_plot import main as sweep_main

        sweep_main(argv[1:])
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
    out = plot(args.run, args.out or Path(args.run) / "curves.png", args.title, extra)
    print(json.dumps({"plot": str(out), "final": summary(args.run)}, indent=2))


if __name__ == "__main__":
    main()
