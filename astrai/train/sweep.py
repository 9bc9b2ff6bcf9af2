"""The jobs of a `-m` sweep, known before the first one runs, and what the sweep left.

Hydra's basic sweeper (the default, and `hparams_search=lr_grid`) takes the cartesian
product of the swept values (`optim.lr=1e-3,3e-3 seed=1,2`: four jobs) and checks only that
each job composes. `job_configs` composes every job the same way (Hydra's own
`split_arguments` and `load_sweep_config`), so the preflight checks each job's config before
any job starts and a bad value in job 3 is reported with its overrides before jobs 0-2 run.
A sweeper that samples as it goes (Optuna) has no job list in advance: its base config is
checked, its jobs as each starts.

`SweepReport` (a Hydra callback) lists at the end of a sweep where each job's export is:
`outputs/latest` is a single run's, so a sweep leaves it alone.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

__all__ = ["SweepReport", "job_configs", "job_overrides", "swept_keys", "swept_overrides"]

log = logging.getLogger(__name__)

BASIC_SWEEPER = "hydra._internal.core_plugins.basic_sweeper.BasicSweeper"
#: a command-line value that sweeps (Hydra's sweep functions; a comma list is the other form)
SWEEP_FUNCTIONS = ("choice(", "range(", "interval(", "tag(", "glob(")


def job_overrides(config: DictConfig) -> list[list[str]] | None:
    """Each job's overrides, in the order the basic sweeper runs them; None when the sweeper
    is another (its jobs are not known in advance)."""
    if str(OmegaConf.select(config, "hydra.sweeper._target_", default="")) != BASIC_SWEEPER:
        return None
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.override_parser.overrides_parser import OverridesParser

    params = OmegaConf.select(config, "hydra.sweeper.params", default=None) or {}
    args = [f"{key}={value}" for key, value in params.items()]
    args += list(OmegaConf.to_container(config.hydra.overrides.task, resolve=False))
    loader = GlobalHydra.instance().config_loader()
    parsed = OverridesParser.create(config_loader=loader).parse_overrides(args)
    return [list(job) for batch in BasicSweeper.split_arguments(parsed, None) for job in batch]


def job_configs(config: DictConfig) -> list[tuple[list[str], DictConfig | Exception]] | None:
    """Each job's overrides with its composed config (or the error composing it raised), as
    the launcher will compose it; None when the jobs are not known in advance."""
    jobs = job_overrides(config)
    if jobs is None:
        return None
    from hydra.core.global_hydra import GlobalHydra

    loader = GlobalHydra.instance().config_loader()
    out: list[tuple[list[str], DictConfig | Exception]] = []
    for overrides in jobs:
        try:
            out.append((overrides, loader.load_sweep_config(config, list(overrides))))
        except Exception as err:  # named with its job by the caller
            out.append((overrides, err))
    return out


def swept_overrides(jobs: list[list[str]], keys: Iterable[str] = ()) -> set[str]:
    """What names a job: the overrides that differ between jobs (a lone job: all of its), and
    every override of a swept key (`keys`), also when the jobs happen to share its value (two
    Optuna trials that drew the same `optim.weight_decay`)."""
    swept = set(keys)
    common = set.intersection(*(set(o) for o in jobs)) if len(jobs) > 1 else set()
    return {o for job in jobs for o in job if o not in common or _key(o) in swept}


def swept_keys(config: DictConfig) -> set[str]:
    """The keys a sweep varies: its sweeper's `params` (Optuna's search space, a grid such as
    hparams_search=lr_grid) and the command line's sweeps (`optim.lr=1e-3,3e-3`)."""
    params = OmegaConf.select(config, "hydra.sweeper.params", default=None) or {}
    keys = {str(k) for k in params}
    task = OmegaConf.select(config, "hydra.overrides.task", default=None) or []
    for override in task:
        key, _, value = str(override).partition("=")
        if "," in value or value.startswith(SWEEP_FUNCTIONS):
            keys.add(key.lstrip("+~"))
    return keys


def _key(override: str) -> str:
    return override.split("=", 1)[0].lstrip("+~")


class SweepReport(Callback):
    """Hydra callback: at the end of a sweep, one line per job with its overrides and export."""

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        root = Path(str(OmegaConf.select(config, "hydra.sweep.dir")))
        jobs = sorted(
            (p for p in root.iterdir() if p.is_dir() and p.name.isdigit()),
            key=lambda p: int(p.name),
        )
        if not jobs:
            return
        overrides = {job: _overrides(job) for job in jobs}
        swept = swept_overrides(list(overrides.values()), swept_keys(config))
        lines = []
        for job in jobs:
            export = job / "export"
            where = str(export) if (export / "config.json").is_file() else "no export"
            label = " ".join(o for o in overrides[job] if o in swept) or "(base config)"
            lines.append(f"  job {job.name} ({label}): {where}")
        log.info(
            "sweep of %d jobs in %s (outputs/latest is left to single runs):\n%s",
            len(jobs),
            root,
            "\n".join(lines),
        )


def _overrides(job: Path) -> list[str]:
    path = job / ".hydra" / "overrides.yaml"
    if not path.is_file():
        return []
    return [str(o) for o in OmegaConf.load(path)]
