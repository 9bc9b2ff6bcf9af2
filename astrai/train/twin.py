"""``python -m astrai.train.twin +experiment=NAME treatment='{key: value, ...}' [overrides]``.

Trains a control arm (the experiment and the overrides) and a treatment arm (the same plus
the treatment's keys) with common random numbers, then reports the treatment's effect on
every metric as paired per-step differences with intervals, and ends with ``eval compare``
on the two exports.

Common random numbers come from the seed: both arms run with the same ``seed``, so they
read the same samples in the same order (the resumable sampler is seeded by it), sample
GRPO's rollouts with the same per-prompt seeds (``rollout_seed + index * count``: prompt i of
the step's batch draws with the same seed in both arms) and draw the same dropout masks.
Each arm is an ordinary ``python -m astrai.train`` run in its own process and folder
(``<out>/control``, ``<out>/treatment``: checkpoints, ledger, export, resume), so a twin
works for every strategy and trainer, multi-process launches included. The arms run at the
same time when the machine has the cores, each on half of them (their thread counts must be
equal: a matmul's last bits depend on it), else one after the other (``parallel=false``).

Both arms write the step ledger (``ledger=true``): its per-step loss, gradient norm and
learning rate (and GRPO's rewards) give a value at every step, and its sample ids, batch
digests and random-state digests show how long the arms stayed coupled. Options: ``out=``,
``parallel=``, ``compare=false``, ``eval=[suites]`` (for the final comparison).
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from astrai.train.twin_stats import Effect, paired_effect

log = logging.getLogger("astrai.train.twin")

__all__ = ["TwinError", "TwinResult", "arm_series", "coupling", "main", "parse_treatment", "twin"]

ARMS = ("control", "treatment")
#: series logged a line per step
HEADLINE = ("ledger/loss", "rollouts/reward_mean")


class TwinError(ValueError):
    """A twin that cannot run as asked (named in the message); nothing was trained."""


@dataclass
class TwinResult:
    out: Path
    metrics: dict[str, dict[str, Any]] = field(default_factory=dict)
    coupling: dict[str, Any] = field(default_factory=dict)
    compare: dict[str, Any] | None = None

    def effect(self, metric: str) -> Effect:
        return Effect(**self.metrics[metric]["effect"])


# ---------------------------------------------------------------------- configuration
def parse_treatment(text: str | Mapping[str, Any]) -> dict[str, Any]:
    """``'{optim.lr: 3e-3, strategy.beta: 0.2}'`` as ``{key: value}``."""
    if isinstance(text, Mapping):
        data = dict(text)
    else:
        from omegaconf import OmegaConf

        try:  # OmegaConf's YAML: 3e-3 is a number, as on Hydra's command line
            data = OmegaConf.to_container(OmegaConf.create(str(text))) if str(text).strip() else {}
        except Exception as err:  # (OmegaConf's and yaml's errors name the position)
            raise TwinError(f"treatment={text!r}: not a mapping ({err})") from None
    if not isinstance(data, dict):
        raise TwinError(f"treatment={text!r}: give a mapping, e.g. treatment='{{optim.lr: 3e-3}}'")
    if "seed" in data:
        raise TwinError(
            "treatment: seed is what couples the arms (the same data order, rollout seeds and "
            "dropout); it cannot differ between them"
        )
    return {str(k): v for k, v in data.items()}


def as_override(key: str, value: Any) -> str:
    """``key=value`` in Hydra's override grammar."""
    return f"{key}={json.dumps(value) if not isinstance(value, str) else value}"


def check_treatment(cfg: Any, treatment: Mapping[str, Any]) -> None:
    from omegaconf import OmegaConf

    missing = object()
    for key in treatment:
        if OmegaConf.select(cfg, key, default=missing, throw_on_missing=False) is missing:
            raise TwinError(f"treatment: {key} is not a key of the composed config")


# ---------------------------------------------------------------------- arms
def _threads(parallel: bool) -> int:
    return max(1, int(os.cpu_count() or 1) // (2 if parallel else 1))


def run_process_arms(arms: Mapping[str, list[str]], out: Path, parallel: bool) -> None:
    """Each arm as ``python -m astrai.train`` with the same thread count."""
    env = {**os.environ, "OMP_NUM_THREADS": str(_threads(parallel)), "ASTRAI_LAUNCH_UID": ""}
    procs: dict[str, Any] = {}
    for arm, overrides in arms.items():
        logfile = open(out / f"{arm}.log", "w")  # noqa: SIM115 (closed below)
        cmd = [sys.executable, "-m", "astrai.train", *overrides]
        log.info("%s: %s (log: %s)", arm, " ".join(cmd[3:]), logfile.name)
        procs[arm] = (
            subprocess.Popen(cmd, stdout=logfile, stderr=subprocess.STDOUT, env=env),
            logfile,
        )
        if not parallel:
            _wait(arm, *procs[arm])
    for arm, (proc, logfile) in procs.items():
        if parallel:
            _wait(arm, proc, logfile)


def _wait(arm: str, proc: Any, logfile: Any) -> None:
    started = time.monotonic()
    code = proc.wait()
    logfile.close()
    if code != 0:
        tail = Path(logfile.name).read_text()[-2000:]
        raise TwinError(f"the {arm} arm failed (exit {code}); its log ends:\n{tail}")
    log.info("%s arm done in %.0f s", arm, time.monotonic() - started)


ArmRunner = Callable[[Mapping[str, list[str]], Path, bool], None]


# ---------------------------------------------------------------------- series
def arm_series(run: Path) -> dict[str, dict[int, float]]:
    """``{metric: {step: value}}`` of one arm: the ledger's per-step values, GRPO's reward
    mean per step (from the ledger's rollouts) and every metric its CSV logger wrote."""
    import csv

    import numpy as np

    from astrai.train.ledger_store import LedgerFile

    series: dict[str, dict[int, float]] = {}
    with LedgerFile(run / "ledger.h5") as ledger:
        for step in ledger.steps:
            row = ledger.step(step)
            for key in ("loss", "grad_norm", "lr"):
                series.setdefault(f"ledger/{key}", {})[step] = float(row[key])
        for seed, at in ledger.rollout_index():
            rewards = ledger.rollout(seed)["rewards"]
            series.setdefault("rollouts/reward_mean", {})[at + 1] = float(np.mean(rewards))
    for path in sorted(run.glob("csv/*/metrics.csv")):
        with path.open() as f:
            for row in csv.DictReader(f):
                if not row.get("step"):
                    continue
                step = int(float(row["step"]))
                for key, value in row.items():
                    if key in ("step", "epoch") or value in ("", None):
                        continue
                    try:
                        series.setdefault(key, {})[step] = float(value)
                    except ValueError:
                        continue
    return series


def coupling(control: Path, treatment: Path) -> dict[str, Any]:
    """Per step: the same samples and batch, the same random state at the step's start; the
    first step where either differs (None: coupled throughout)."""
    from astrai.train.ledger_store import LedgerFile

    with LedgerFile(control / "ledger.h5") as a, LedgerFile(treatment / "ledger.h5") as b:
        same_start = a.meta.get("start_digest") == b.meta.get("start_digest")
        steps = sorted(set(a.steps) & set(b.steps))
        rows, first = [], None
        previous = (None, None)
        for step in steps:
            ra, rb = a.step(step), b.step(step)
            data = ra["sample_ids"] == rb["sample_ids"] and ra["batch_digest"] == rb["batch_digest"]
            rng = previous[0] == previous[1]
            rows.append({"step": step, "data": data, "rng": rng})
            if first is None and not (data and rng):
                first = step
            previous = (ra["rng_digest"], rb["rng_digest"])
    return {"same_start": same_start, "first_decoupled_step": first, "steps": rows}


def paired_table(
    control: dict[str, dict[int, float]], treatment: dict[str, dict[int, float]]
) -> dict[str, dict[str, Any]]:
    """Per metric both arms have: steps, values, differences, the effect over all steps and
    over the last half, and the running effect at up to 20 points."""
    out = {}
    for metric in sorted(set(control) & set(treatment)):
        steps = sorted(set(control[metric]) & set(treatment[metric]))
        if not steps:
            continue
        c = [control[metric][s] for s in steps]
        t = [treatment[metric][s] for s in steps]
        half = len(steps) // 2
        every = max(1, len(steps) // 20)
        running = [
            {"step": steps[k - 1], **paired_effect(c[:k], t[:k]).to_dict()}
            for k in range(every, len(steps) + 1, every)
        ]
        out[metric] = {
            "steps": steps,
            "control": c,
            "treatment": t,
            "diff": [b - a for a, b in zip(c, t)],
            "effect": paired_effect(c, t).to_dict(),
            "effect_last_half": paired_effect(c[half:], t[half:]).to_dict(),
            "running": running,
        }
    return out


def log_steps(table: Mapping[str, Mapping[str, Any]]) -> None:
    """One line per step of the headline series: both arms, the difference, the effect so far."""
    for metric in HEADLINE:
        if metric not in table:
            continue
        m = table[metric]
        marks = {r["step"]: r for r in m["running"]}
        for step, a, b, d in zip(m["steps"], m["control"], m["treatment"], m["diff"]):
            mark = marks.get(step)
            so_far = (
                f"  effect so far {Effect(**{k: mark[k] for k in ('mean', 'low', 'high', 'n')})}"
                if mark
                else ""
            )
            log.info(
                "step %d %s: control %.6g treatment %.6g diff %+.4g%s",
                step,
                metric,
                a,
                b,
                d,
                so_far,
            )


def format_table(table: Mapping[str, Mapping[str, Any]]) -> str:
    lines = [
        "| metric | steps | control (last) | treatment (last) | paired diff, all steps [95% CI] | last half [95% CI] |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for metric, m in table.items():
        lines.append(
            f"| {metric} | {len(m['steps'])} | {m['control'][-1]:.6g} | {m['treatment'][-1]:.6g} "
            f"| {Effect(**m['effect'])} | {Effect(**m['effect_last_half'])} |"
        )
    return "\n".join(lines)


# ---------------------------------------------------------------------- the twin
def _compare_args(cfg: Any, suites: Sequence[str] | None) -> list[str]:
    from omegaconf import OmegaConf

    if suites is None:
        nodes = OmegaConf.select(cfg, "callbacks.eval.suites", default=None) or {}
        suites = list(nodes) or ["perplexity"]
        extra = [
            f"suites.{name}.{key}={value}"
            for name in nodes
            for key, value in OmegaConf.to_container(nodes[name], resolve=True).items()
            if key in ("num_prompts", "max_tokens", "limit", "num_samples")
        ]
    else:
        extra = []
    return [f"eval=[{','.join(suites)}]", *extra]


def twin(
    overrides: Sequence[str],
    treatment: str | Mapping[str, Any],
    out: str | Path | None = None,
    parallel: bool | None = None,
    compare: bool = True,
    suites: Sequence[str] | None = None,
    runner: ArmRunner = run_process_arms,
    compare_overrides: Sequence[str] = (),
) -> TwinResult:
    """Train the twins and report the paired effects (see the module docstring)."""
    from astrai.train.preflight import problems
    from astrai.train.runner import compose

    changes = parse_treatment(treatment)
    common = [o for o in overrides if not o.startswith(("ledger=", "hydra.run.dir="))]
    if not any(o.lstrip("+").startswith("logger=") for o in common):
        common.append("logger=csv")
    control_cfg = compose([*common, "ledger=true"])
    check_treatment(control_cfg, changes)
    treated = [*common, *(as_override(k, v) for k, v in changes.items())]
    treatment_cfg = compose([*treated, "ledger=true"])
    for arm, cfg in zip(ARMS, (control_cfg, treatment_cfg), strict=True):
        found = problems(cfg)
        if found:
            raise TwinError(f"the {arm} arm: " + "; ".join(found))
    if out is None:
        stamp = time.strftime("%Y-%m-%d_%H-%M-%S")
        out = Path(str(control_cfg.paths.log_dir)) / f"{control_cfg.name}_twin" / stamp
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    if parallel is None:  # both arms at once when each gets a core or more
        parallel = (os.cpu_count() or 1) >= 2
    arms = {
        "control": [*common, "ledger=true", f"hydra.run.dir={out / 'control'}"],
        "treatment": [*treated, "ledger=true", f"hydra.run.dir={out / 'treatment'}"],
    }
    log.info(
        "twin of %s: treatment %s, seed %s, out %s",
        control_cfg.name,
        changes,
        control_cfg.seed,
        out,
    )
    runner(arms, out, bool(parallel))

    result = TwinResult(out)
    series = {arm: arm_series(out / arm) for arm in ARMS}
    result.metrics = paired_table(series["control"], series["treatment"])
    result.coupling = coupling(out / "control", out / "treatment")
    log_steps(result.metrics)
    first = result.coupling["first_decoupled_step"]
    log.info(
        "coupling: %s",
        "the same samples and random state at every step"
        if first is None
        else f"the arms drew different samples or random numbers from step {first} on",
    )
    table = format_table(result.metrics)
    (out / "twin.md").write_text(table + "\n")
    (out / "twin.json").write_text(
        json.dumps(
            {"treatment": changes, "metrics": result.metrics, "coupling": result.coupling}, indent=1
        )
    )
    print(table)
    if compare:
        exports = [out / arm / "export" for arm in ARMS]
        if all(e.is_dir() for e in exports):
            cmd = [
                sys.executable,
                "-m",
                "astrai.eval",
                "compare",
                *map(str, exports),
                *_compare_args(control_cfg, suites),
                *compare_overrides,
                f"out={out / 'compare.json'}",
            ]
            log.info("eval compare: %s", " ".join(cmd[3:]))
            proc = subprocess.run(cmd, capture_output=True, text=True)
            if proc.returncode != 0:
                raise TwinError(f"eval compare failed:\n{proc.stderr[-2000:]}")
            print(proc.stdout)
            result.compare = json.loads((out / "compare.json").read_text())
        else:
            log.warning("eval compare skipped: an arm has no export (%s)", exports)
    return result


def parse_args(argv: Sequence[str]) -> dict[str, Any]:
    args: dict[str, Any] = {"overrides": [], "treatment": None, "compare_overrides": []}
    for arg in argv:
        if arg in ("-h", "--help"):
            raise SystemExit(__doc__)
        key, eq, value = arg.partition("=")
        if key == "treatment":
            args["treatment"] = value
        elif key in ("out", "parallel", "compare"):
            args[key] = value
        elif key == "eval":
            args["suites"] = [s.strip() for s in value.strip("[]").split(",") if s.strip()]
        elif key.startswith("suites."):  # the final comparison's suite options
            args["compare_overrides"].append(arg)
        elif eq:
            args["overrides"].append(arg)
        else:
            raise SystemExit(f"astrai.train.twin: {arg}: give key=value overrides")
    if args["treatment"] is None:
        raise SystemExit(
            "usage: python -m astrai.train.twin +experiment=NAME treatment='{optim.lr: 3e-3}' "
            "[overrides] [out=DIR] [parallel=true|false] [compare=false] [eval=[suites]]"
        )
    for key in ("parallel", "compare"):
        if key in args:
            if args[key].lower() not in ("true", "false"):
                raise SystemExit(f"astrai.train.twin: {key}={args[key]}: true or false")
            args[key] = args[key].lower() == "true"
    return args


def main(argv: Sequence[str] | None = None) -> int:
    from astrai.runtime import setup_logging

    logging.basicConfig(level=logging.INFO, format="[%(name)s] %(message)s")
    setup_logging("info")
    args = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        twin(
            args["overrides"],
            args["treatment"],
            out=args.get("out"),
            parallel=args.get("parallel"),
            compare=args.get("compare", True),
            suites=args.get("suites"),
            compare_overrides=args["compare_overrides"],
        )
    except TwinError as err:
        raise SystemExit(f"astrai.train.twin: {err}") from None
    return 0


if __name__ == "__main__":
    sys.exit(main())
