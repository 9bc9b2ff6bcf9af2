"""Asynchronous GRPO benchmark: wall time per optimizer step and the trainer's idle fraction,
synchronous against ``async_rollouts`` (the generator thread samples the next batch while the
trainer trains), on a recipe's real training run.

Each mode is one ``python -m astrai.train +experiment=<experiment>`` process (so each has
its own threads and nothing carries over), ``steps`` optimizer steps, the first ``warmup``
left out of the timing, evaluation and checkpoints off. A callback (:class:`StepTimer`)
records every step's wall time and the trainer's idle seconds: the time it waited for
rollouts (synchronously: all the sampling). The machine's threads are split as configured:
``sync`` gives every one of ``threads`` to the one thread that samples and trains; the
asynchronous modes give ``generator_threads`` to the generator and the rest (at least one)
to the trainer.
Options: ``conf/bench/grpo_async.yaml``.
"""

from __future__ import annotations

import json
import logging
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import lightning as L

from astrai.bench.common import as_list

if TYPE_CHECKING:
    from astrai.train.strategies.grpo import GRPOModule

logger = logging.getLogger(__name__)

REPO = Path(__file__).resolve().parents[2]


class StepTimer(L.Callback):
    """Every optimizer step's wall time and the trainer's idle seconds, written to ``out``
    (JSON) when the fit ends."""

    def __init__(self, out: str) -> None:
        self.out = out
        self.steps: list[dict[str, float]] = []
        self._started: float | None = None
        self._idle = 0.0

    def on_train_batch_start(self, trainer: Any, module: Any, batch: Any, idx: int) -> None:
        if self._started is None:
            self._started = time.perf_counter()

    def on_train_batch_end(
        self, trainer: Any, module: GRPOModule, out: Any, batch: Any, i: int
    ) -> None:
        self._idle += float(module.idle_seconds)
        if trainer.global_step > len(self.steps):  # an optimizer step completed
            now = time.perf_counter()
            self.steps.append({"seconds": now - self._started, "idle": self._idle})
            self._started, self._idle = now, 0.0

    def on_fit_end(self, trainer: Any, module: Any) -> None:
        Path(self.out).write_text(json.dumps(self.steps))


def _overrides(cfg: dict[str, Any], mode: str, out: Path, tmp: Path) -> list[str]:
    args = [
        f"+experiment={cfg['experiment']}",
        f"trainer.max_steps={cfg['steps']}",
        "callbacks.model_checkpoint.every_n_train_steps=1000000",
        "callbacks.model_checkpoint.save_last=false",
        "export=false",
        "callbacks=default",  # no evaluation: the steps alone are timed
        "callbacks.progress_bar=null",
        f"+callbacks.step_timer._target_={__name__}.StepTimer",
        f"+callbacks.step_timer.out={out}",
        "logger=csv",
        f"paths.output_dir={tmp / mode}",
        f"hydra.run.dir={tmp / mode}",
        f"name=bench_{mode}",
    ]
    if cfg.get("model_path"):
        args.append(f"strategy.init_from={cfg['model_path']}")
    if mode != "sync":
        k = int(mode.removeprefix("async"))
        args.append(
            f"strategy.async_rollouts={{max_staleness: {k}, "
            f"generator_threads: {cfg['generator_threads']}}}"
        )
    return args + [str(o) for o in as_list(cfg.get("overrides") or [])]


def run_mode(cfg: dict[str, Any], mode: str, tmp: Path) -> dict[str, Any]:
    """One mode's training process and its per-step timings."""
    out = tmp / f"{mode}.json"
    threads = cfg["threads"]
    if mode != "sync":
        threads = max(1, threads - cfg["generator_threads"])
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "WANDB_MODE": "disabled"}
    started = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-m", "astrai.train", *_overrides(cfg, mode, out, tmp)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"{mode}: the training run failed:\n{proc.stderr[-4000:]}")
    steps = json.loads(out.read_text())[cfg["warmup"] :]
    seconds = [s["seconds"] for s in steps]
    return {
        "mode": mode,
        "trainer_threads": threads,
        "steps_timed": len(steps),
        "seconds_per_step": statistics.mean(seconds),
        "median_seconds_per_step": statistics.median(seconds),
        "trainer_idle_frac": sum(s["idle"] for s in steps) / sum(seconds),
        "wall_seconds": time.perf_counter() - started,
    }


def run(cfg: dict[str, Any]) -> dict[str, Any]:
    modes = [str(m) for m in as_list(cfg["modes"])]
    bad = [m for m in modes if m != "sync" and not (m.startswith("async") and m[5:].isdigit())]
    if bad:
        raise ValueError(f"modes: unknown {bad}; use sync and asyncK (K: max_staleness)")
    if not 1 <= cfg["generator_threads"] <= cfg["threads"]:
        raise ValueError(
            f"generator_threads must be in [1, threads], got {cfg['generator_threads']} of "
            f"{cfg['threads']}"
        )
    with tempfile.TemporaryDirectory() as tmp:
        rows = {m: run_mode(cfg, m, Path(tmp)) for m in modes}
    report: dict[str, Any] = {
        "config": cfg,
        "load": os.getloadavg(),
        "cpus": os.cpu_count(),
        "rows": rows,
    }
    if "sync" in rows:
        for mode, row in rows.items():
            if mode != "sync":
                report[f"{mode}_speedup"] = (
                    rows["sync"]["seconds_per_step"] / row["seconds_per_step"]
                )
    return report


def format_report(report: dict[str, Any]) -> str:
    c = report["config"]
    lines = [
        f"GRPO sync vs async: +experiment={c['experiment']}, {c['steps']} steps ({c['warmup']} "
        f"untimed), {c['threads']} threads ({c['generator_threads']} to the generator when "
        f"async); load {report['load'][0]:.2f}",
        f"{'mode':<8} {'s/step':>8} {'median':>8} {'idle':>6}",
    ]
    for row in report["rows"].values():
        lines.append(
            f"{row['mode']:<8} {row['seconds_per_step']:>8.3f} "
            f"{row['median_seconds_per_step']:>8.3f} {row['trainer_idle_frac']:>6.1%}"
        )
    lines += [f"{k}: {v:.2f}x" for k, v in report.items() if k.endswith("_speedup")]
    return "\n".join(lines)
