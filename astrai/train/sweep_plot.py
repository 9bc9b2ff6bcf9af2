"""Plot a sweep's final metric against one swept parameter, one point per job:
`python -m astrai.train.plot sweep MULTIRUN_DIR --param optim.lr --metric eval/exact_match`.

A multirun folder (`outputs/<name>/multirun/<stamp>/`) holds one folder per job, each with
Hydra's `.hydra/overrides.yaml` and `.hydra/config.yaml` and the job's CSV logs. The
parameter's value is read from the job's overrides (the swept value as given), else from its
config; the metric's value is its last logged value (`--reduce max|min` for the best one).
Writes the PNG (log x axis for a positive numeric parameter) and, beside it, the table as
`<out>.md` and `<out>.csv`. A job without the metric (crashed, diverged before it was logged)
is a row marked `missing` and no point. Needs matplotlib (in the `dev` extra).
"""

from __future__ import annotations

import argparse
import csv
import json
import logging
import math
from collections import defaultdict
from dataclasses import asdict, dataclass
from pathlib import Path

from omegaconf import OmegaConf

from astrai.train.figures import pyplot, save_figure
from astrai.train.logs import read_metrics

log = logging.getLogger(__name__)

__all__ = ["SweepRow", "job_dirs", "job_param", "plot_sweep", "read_sweep", "write_table"]

REDUCERS = {"last": lambda v: v[-1], "max": max, "min": min}


@dataclass
class SweepRow:
    """One job of a sweep: its folder (relative to the sweep), the parameter's value as
    written, and the metric (None when the job never logged it)."""

    job: str
    param: str
    value: float | None


def job_dirs(sweep: str | Path) -> list[Path]:
    """The job folders under a multirun folder (any folder holding `.hydra/overrides.yaml`),
    in job order (numeric names numerically)."""
    sweep = Path(sweep)
    jobs = [p.parent.parent for p in sweep.glob("**/.hydra/overrides.yaml")]
    if not jobs:
        raise FileNotFoundError(f"no job folders (*/.hydra/overrides.yaml) under {sweep}")

    def key(p: Path) -> tuple:
        rel = p.relative_to(sweep).parts
        return tuple((0, int(s), "") if s.isdigit() else (1, 0, s) for s in rel)

    return sorted(jobs, key=key)


def job_param(job: str | Path, param: str) -> str | None:
    """The value of `param` (a dotted config key) in a job: from its overrides (`key=value`,
    also `+key=` / `++key=`), else from its saved config; None when it has neither."""
    hydra_dir = Path(job) / ".hydra"
    for line in OmegaConf.load(hydra_dir / "overrides.yaml") or []:
        key, sep, value = str(line).partition("=")
        if sep and key.lstrip("+") == param:
            return value
    config = hydra_dir / "config.yaml"
    if config.is_file():
        value = OmegaConf.select(OmegaConf.load(config), param, default=None)
        if value is not None and not OmegaConf.is_config(value):
            return str(value)
    return None


def read_sweep(sweep: str | Path, param: str, metric: str, reduce: str = "last") -> list[SweepRow]:
    """One row per job with `param`; the metric reduced over the job's logged steps."""
    if reduce not in REDUCERS:
        raise ValueError(f"reduce: {reduce!r} is not one of {sorted(REDUCERS)}")
    sweep = Path(sweep)
    rows = []
    for job in job_dirs(sweep):
        value = job_param(job, param)
        if value is None:
            log.warning("%s: no %s in its overrides or config; skipped", job, param)
            continue
        try:
            series = read_metrics(job).get(metric)
        except FileNotFoundError:
            series = None
        result = REDUCERS[reduce]([v for _, v in series]) if series else None
        if result is None:
            log.warning("%s (%s=%s): %s never logged", job, param, value, metric)
        rows.append(SweepRow(str(job.relative_to(sweep)), value, result))
    if not rows:
        raise ValueError(f"param: no job under {sweep} sets {param}")
    return rows


def _numeric(values: list[str]) -> list[float] | None:
    try:
        return [float(v) for v in values]
    except ValueError:
        return None


def write_table(
    rows: list[SweepRow], out: str | Path, param: str, metric: str, goal: str
) -> tuple[Path, Path]:
    """`<out>.md` (best value in bold) and `<out>.csv`: job, parameter, metric."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    found = [r.value for r in rows if r.value is not None and math.isfinite(r.value)]
    best = (max if goal == "max" else min)(found) if found else None
    lines = [f"| job | {param} | {metric} |", "|---|---:|---:|"]
    for r in rows:
        if r.value is None:
            cell = "missing"
        else:
            cell = f"{r.value:.4g}"
            if r.value == best:
                cell = f"**{cell}**"
        lines.append(f"| {r.job} | {r.param} | {cell} |")
    md = out.with_suffix(".md")
    md.write_text("\n".join(lines) + "\n")
    table = out.with_suffix(".csv")
    with open(table, "w", newline="") as fh:
        writer = csv.writer(fh)
        writer.writerow(["job", param, metric])
        for r in rows:
            writer.writerow([r.job, r.param, "" if r.value is None else repr(r.value)])
    return md, table


def plot_sweep(
    rows: list[SweepRow], out: str | Path, param: str, metric: str, title: str | None = None
) -> Path:
    """Every job as a point and the mean per parameter value as a line; log x axis when
    the parameter is numeric and positive, else categories in sweep order."""
    plt = pyplot()
    points = [r for r in rows if r.value is not None and math.isfinite(r.value)]
    params = list(dict.fromkeys(r.param for r in rows))
    numeric = _numeric(params)
    position = dict(zip(params, numeric if numeric else range(len(params))))
    fig, ax = plt.subplots(figsize=(5.5, 4))
    groups: dict[float, list[float]] = defaultdict(list)
    for r in points:
        groups[position[r.param]].append(r.value)
    xs = sorted(groups)
    ax.plot(xs, [sum(groups[x]) / len(groups[x]) for x in xs], "-", alpha=0.6)
    ax.plot([position[r.param] for r in points], [r.value for r in points], "o")
    if numeric and all(x > 0 for x in numeric):
        ax.set_xscale("log")
    if not numeric:
        ax.set_xticks(range(len(params)), params)
    ax.set_xlabel(param)
    ax.set_ylabel(metric)
    ax.grid(alpha=0.3, which="both")
    ax.set_title(title or f"{metric} vs {param}")
    fig.tight_layout()
    return save_figure(fig, out)


def default_goal(metric: str) -> str:
    """`min` for losses, perplexities and bits per byte, `max` for anything else."""
    return "min" if any(k in metric for k in ("loss", "ppl", "bpb")) else "max"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m astrai.train.plot sweep", description=__doc__.splitlines()[0]
    )
    parser.add_argument("sweep", help="a multirun folder (one sub-folder per job)")
    parser.add_argument("--param", required=True, help="swept config key, e.g. optim.lr")
    parser.add_argument("--metric", required=True, help="logged metric, e.g. eval/exact_match")
    parser.add_argument("--out", default=None, help="PNG path (default: <sweep>/sweep.png)")
    parser.add_argument("--reduce", choices=sorted(REDUCERS), default="last")
    parser.add_argument("--goal", choices=["max", "min"], default=None, help="which is best")
    parser.add_argument("--title", default=None)
    args = parser.parse_args(argv)
    rows = read_sweep(args.sweep, args.param, args.metric, args.reduce)
    out = Path(args.out) if args.out else Path(args.sweep) / "sweep.png"
    goal = args.goal or default_goal(args.metric)
    png = plot_sweep(rows, out, args.param, args.metric, args.title)
    md, table = write_table(rows, out, args.param, args.metric, goal)
    result = {"plot": str(png), "table": [str(md), str(table)], "rows": [asdict(r) for r in rows]}
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
