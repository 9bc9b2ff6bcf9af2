"""astrai vs TRL: training step time of SFT, DPO and GRPO (rollouts included).

``python -m astrai.bench train_trl [workloads=[sft,dpo,grpo]] [out=report.json]``
(``conf/bench/train_trl.yaml``). Both sides train one random-weight Qwen3-style checkpoint
built here (:mod:`~astrai.bench.train_trl_data`; astrai imports the HF directory), on the
same batch of the same tokens at every step, with matched settings, in one process with one
torch thread: astrai through its strategy LightningModule and a Lightning Trainer
(:mod:`~astrai.bench.train_trl_astrai`), TRL through its own trainers
(:mod:`~astrai.bench.train_trl_peer`). Each workload runs ``repeats`` times per side, the
sides alternated (and which goes first); a run's figure is the median of its ``steps`` timed
steps after ``warmup_steps``, a side's the best of its runs. GRPO is 16 prompts x 8
completions of exactly 64 tokens per step; astrai's GRPO step is also split into phases
(:mod:`~astrai.bench.train_trl_profile`).

Targets (issue #52): astrai's GRPO step >= 1.5x faster than TRL's, SFT and DPO >= 1.0x.
"""

from __future__ import annotations

import gc
import logging
import math
import os
import statistics
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from astrai.bench.common import as_list
from astrai.bench.train_trl_data import build_checkpoint, workload_data

logger = logging.getLogger(__name__)

WORKLOADS = ("sft", "dpo", "grpo")
TARGETS = {"sft": 1.0, "dpo": 1.0, "grpo": 1.5}


def check_options(cfg: Mapping[str, Any]) -> list[str]:
    """The workloads to run; a bad option is a `SystemExit` naming it, before any model."""
    workloads = [str(w) for w in as_list(cfg["workloads"])]
    bad = [w for w in workloads if w not in WORKLOADS]
    if bad or not workloads:
        raise SystemExit(
            f"option workloads={workloads}: unknown {bad or 'none given'}; "
            f"choose from {', '.join(WORKLOADS)}"
        )
    for key, low in (("steps", 1), ("warmup_steps", 1), ("repeats", 1), ("threads", 1)):
        if int(cfg[key]) < low:
            raise SystemExit(f"option {key}={cfg[key]}: must be >= {low}")
    if "grpo" in workloads:
        g = cfg["grpo"]
        for key in ("num_generations", "max_new_tokens"):
            if g["strategy"][key] != g[key]:
                raise SystemExit(
                    f"option grpo.strategy.{key}={g['strategy'][key]}: set grpo.{key} "
                    "(both sides read it)"
                )
        if int(g["num_generations"]) < 2:
            raise SystemExit(f"option grpo.num_generations={g['num_generations']}: must be >= 2")
    return workloads


def _timed(
    stamps: list[float], cpu: list[float], losses: list[torch.Tensor], warmup: int
) -> dict[str, Any]:
    """A run's figures: ``stamps[0]`` is when its first step started, ``stamps[i]`` when
    step ``i`` ended; the steps after ``warmup`` are timed."""
    steps = [b - a for a, b in zip(stamps[warmup:], stamps[warmup + 1 :])]
    return {
        "steps": len(steps),
        "step_seconds": steps,
        "step_median_s": statistics.median(steps),
        "cpu_seconds": cpu[-1] - cpu[warmup],
        "losses": [float(x) for x in losses],
        "threads": torch.get_num_threads(),
    }


class Tokens:
    """Completion tokens per step, seen by a rollout observer or a reward function."""

    def __init__(self) -> None:
        self.per_call: list[int] = []

    def add(self, count: int) -> None:
        self.per_call.append(count)


def run_side(
    side: str, cfg: Mapping[str, Any], workload: str, data: Any, checkpoint: Path
) -> dict[str, Any]:
    """One run of ``workload`` on ``side`` (astrai or trl): its timed figures."""
    warmup = int(cfg["warmup_steps"])
    tokens = Tokens()
    if side == "astrai":
        from astrai.bench.train_trl_astrai import RolloutTokens, run_astrai
        from astrai.bench.train_trl_profile import GRPOStepProfile, summarise

        callbacks = []
        profile = GRPOStepProfile() if workload == "grpo" and cfg["profile"] else None
        if profile is not None:
            callbacks.append(profile)
        if workload == "grpo":
            callbacks.append(RolloutTokens(tokens.add))
        clock = run_astrai(cfg, workload, data, checkpoint, callbacks)
        result = _timed(clock.stamps, clock.cpu, clock.losses, warmup)
        if profile is not None:
            result["profile"] = summarise(profile.steps[warmup:])
    else:
        from astrai.bench.train_trl_peer import run_trl

        clock, losses = run_trl(cfg, workload, data, checkpoint, tokens.add)
        result = _timed(clock.stamps, clock.cpu, losses, warmup)
    if workload == "grpo":
        result["completion_tokens_per_step"] = tokens.per_call
    return result


def _best(runs: list[dict[str, Any]]) -> dict[str, Any]:
    best = dict(min(runs, key=lambda r: r["step_median_s"]))
    best["runs_step_median_s"] = [r["step_median_s"] for r in runs]
    return best


def run(cfg: dict[str, Any]) -> dict[str, Any]:
    """Every workload on both sides, ``repeats`` times, alternating."""
    workloads = check_options(cfg)
    torch.set_num_threads(int(cfg["threads"]))
    load_before = os.getloadavg()
    report: dict[str, Any] = {"config": cfg, "workloads": {}}
    with tempfile.TemporaryDirectory() as tmp:
        checkpoint = build_checkpoint(Path(tmp) / "qwen3", cfg["model"], int(cfg["seed"]))
        data = workload_data(cfg, int(cfg["model"]["vocab_size"]))
        for workload in workloads:
            runs: dict[str, list[dict[str, Any]]] = {"astrai": [], "trl": []}
            for r in range(int(cfg["repeats"])):
                order = ("astrai", "trl") if r % 2 == 0 else ("trl", "astrai")
                for side in order:
                    result = run_side(side, cfg, workload, data[workload], checkpoint)
                    runs[side].append(result)
                    gc.collect()
                    logger.info(
                        "%s %s run %d: median step %.1f ms",
                        workload,
                        side,
                        r + 1,
                        result["step_median_s"] * 1e3,
                    )
            report["workloads"][workload] = _compare(workload, runs)
    report["threads"] = torch.get_num_threads()
    report["load_avg"] = {"before": list(load_before), "after": list(os.getloadavg())}
    report["cpus"] = os.cpu_count()
    return report


def _compare(workload: str, runs: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """Both sides' best runs, the speed-up (TRL's median step / astrai's) and the checks
    that they did the same work."""
    out: dict[str, Any] = {side: _best(side_runs) for side, side_runs in runs.items()}
    a, t = out["astrai"], out["trl"]
    out["speedup"] = t["step_median_s"] / a["step_median_s"]
    # this process's CPU time over the timed steps (one thread: its compute), which other
    # processes on a shared machine disturb far less than the wall clock
    out["speedup_cpu_time"] = min(r["cpu_seconds"] for r in runs["trl"]) / min(
        r["cpu_seconds"] for r in runs["astrai"]
    )
    pairs = [x["step_median_s"] / y["step_median_s"] for y, x in zip(runs["astrai"], runs["trl"])]
    out["speedup_pair_median"] = statistics.median(pairs)
    out["target"] = TARGETS[workload]
    out["met"] = out["speedup"] >= TARGETS[workload]
    out["first_loss"] = {"astrai": a["losses"][0], "trl": t["losses"][0]}
    out["finite_losses"] = all(
        math.isfinite(x) for side in runs.values() for r in side for x in r["losses"]
    )
    return out


def format_report(report: Mapping[str, Any]) -> str:
    """The table: each workload's median step on both sides and the speed-up; GRPO's
    profile."""
    from astrai.bench.train_trl_profile import format_profile

    c = report["config"]
    load = report["load_avg"]
    lines = [
        f"astrai vs TRL: Qwen3-style random checkpoint (hidden {c['model']['hidden_size']}, "
        f"{c['model']['num_hidden_layers']} layers, vocab {c['model']['vocab_size']}), "
        f"{report['threads']} thread(s), {c['steps']} timed steps after {c['warmup_steps']}, "
        f"{c['repeats']} runs per side; load {load['before'][0]:.2f} -> {load['after'][0]:.2f}",
        f"{'workload':<9} {'astrai ms':>10} {'TRL ms':>10} {'speed-up':>9} {'pairs':>7} "
        f"{'CPU s':>7} {'target':>7}  first loss (astrai / TRL)",
    ]
    for name, w in report["workloads"].items():
        lines.append(
            f"{name:<9} {w['astrai']['step_median_s'] * 1e3:10.1f} "
            f"{w['trl']['step_median_s'] * 1e3:10.1f} {w['speedup']:8.2f}x "
            f"{w['speedup_pair_median']:6.2f}x {w['speedup_cpu_time']:6.2f}x "
            f"{w['target']:6.1f}x {'met' if w['met'] else 'MISSED'}"
            f"  {w['first_loss']['astrai']:.4f} / {w['first_loss']['trl']:.4f}"
        )
    grpo = report["workloads"].get("grpo")
    if grpo is not None and "profile" in grpo["astrai"]:
        lines.append("astrai GRPO step by phase (median over the timed steps of the best run):")
        lines += format_profile(grpo["astrai"]["profile"])
    return "\n".join(lines)
