"""A run's logged metrics, read back from its CSV logs (one `metrics.csv` per launch)."""

from __future__ import annotations

import csv
from collections import defaultdict
from pathlib import Path

__all__ = ["read_metrics", "run_name", "summary"]


def run_name(run: str | Path) -> str:
    """What a run's figures are titled: its experiment (`name` in `.hydra/config.yaml`) and
    its folder, resolved through links, so `outputs/latest` is named by the run it points at
    (`tiny_sft 2026-11-30_17-45-32`), not `latest`."""
    real = Path(run).resolve()
    saved = real / ".hydra" / "config.yaml"
    name = None
    if saved.is_file():
        from omegaconf import OmegaConf

        try:
            name = OmegaConf.load(saved).get("name")
        except Exception:  # a hand-edited or cut-short config: the folder still names it
            name = None
    return f"{name} {real.name}" if name and str(name) != real.name else real.name


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
