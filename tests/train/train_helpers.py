"""Helpers for the training tests: small settings and `python -m astrai.train` runs."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]

# small settings shared by the CLI tests (the cache key includes them: one build per session)
SMALL = [
    "tokenizer.train.max_bytes=400000",
    "data.train.prepare.builtin.max_bytes=300000",
    "data.val.prepare.builtin.max_bytes=60000",
]
TINY_MODEL = ["model=tiny", "tokenizer.train.vocab_size=512"]
#: tiny_grpo at test size with its evaluation callback, in 3 steps (debug=fast): the runs of
#: the policy-engine and live-policy-server tests
TINY_GRPO_EVAL = [
    "+experiment=tiny_grpo",
    *TINY_MODEL,
    "tokenizer.train.max_bytes=400000",
    "data.train.prepare.builtin.n=32",
    "data.batch_size=2",
    "strategy.init_from=null",
    "strategy.num_generations=4",
    "strategy.max_new_tokens=8",
    "callbacks.eval.suites.arithmetic.num_prompts=4",
    "callbacks.eval.suites.arithmetic.max_tokens=8",
    "debug=fast",
    "callbacks.progress_bar=null",
]


def run_dirs(tmp: Path, data_dir: Path) -> list[str]:
    """Overrides that keep a run's outputs under `tmp` and share the session's data cache."""
    return [
        f"paths.data_dir={data_dir}",
        f"paths.log_dir={tmp / 'outputs'}",
        f"hydra.run.dir={tmp / 'run'}",
        f"hydra.sweep.dir={tmp / 'multirun'}",
    ]


def train_run(where: Path, data_dir: Path, extra: list[str], base: list[str]) -> Path:
    """`astrai.train` in this process with `base + extra`, its outputs under `where`; returns
    the run folder."""
    from astrai.train import runner

    run = where / "run"
    paths = [f"paths.output_dir={run}", f"paths.log_dir={where / 'outputs'}"]
    runner.train(runner.compose([*base, *extra, *paths, f"paths.data_dir={data_dir}"]))
    return run


def cli(
    args: list[str], *, timeout: float = 300, check: bool = True, env: dict | None = None
) -> subprocess.CompletedProcess:
    """`python -m astrai.train ARGS` in a subprocess (W&B offline, no network); `env` adds
    variables to the current environment. One torch thread unless the environment names a
    count: the runs a test compares bit for bit must use the same count (a parallel
    reduction's rounding depends on it), and the load-based default varies from run to run
    on a busy machine."""
    full_env = {
        "OMP_NUM_THREADS": "1",
        **os.environ,
        "WANDB_MODE": "offline",
        "HF_HUB_OFFLINE": "1",
        **(env or {}),
    }
    proc = subprocess.run(
        [sys.executable, "-m", "astrai.train", *args],
        cwd=REPO,
        env=full_env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    if check and proc.returncode != 0:
        raise AssertionError(
            f"astrai.train {' '.join(args)} failed ({proc.returncode}):\n"
            f"{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
        )
    return proc


def final_state(run: Path, steps: int) -> tuple[dict, list]:
    """Weights and every optimizer-state tensor of a run's `last.ckpt`, which must be at
    global step `steps` (the run finished)."""
    import torch

    ckpt = torch.load(run / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=False)
    assert ckpt["global_step"] == steps
    opt = [
        t
        for state in ckpt["optimizer_states"]
        for per_param in state["state"].values()
        for t in per_param.values()
        if isinstance(t, torch.Tensor)
    ]
    return ckpt["state_dict"], opt


def checkpoint_differences(a: Path, b: Path, steps: int) -> list[str]:
    """The weights and optimizer tensors in which two finished runs' `last.ckpt` differ
    (bit for bit): empty when an interrupted, resumed run equals the uninterrupted one."""
    import torch

    (wa, oa), (wb, ob) = final_state(a, steps), final_state(b, steps)
    assert wa.keys() == wb.keys() and len(oa) == len(ob) > 0
    return [k for k in wa if not torch.equal(wa[k], wb[k])] + [
        f"optimizer tensor {i}" for i, (x, y) in enumerate(zip(oa, ob)) if not torch.equal(x, y)
    ]


def quiet_trainer(**overrides: Any) -> Any:
    """A CPU `lightning.Trainer` for in-process tests: no logger, checkpoints, progress bar or
    model summary unless `overrides` ask for them."""
    import lightning as L

    kwargs: dict[str, Any] = {
        "accelerator": "cpu",
        "logger": False,
        "enable_checkpointing": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
    }
    return L.Trainer(**{**kwargs, **overrides})


def memory_logger() -> Any:
    """A Lightning logger that keeps every logged row in memory (its `rows`)."""
    from lightning.pytorch.loggers import Logger

    class MemoryLogger(Logger):
        def __init__(self) -> None:
            super().__init__()
            self.rows: list[dict[str, float]] = []

        @property
        def name(self) -> str:
            return "memory"

        @property
        def version(self) -> int:
            return 0

        def log_hyperparams(self, *args: Any, **kwargs: Any) -> None:
            pass

        def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
            self.rows.append(dict(metrics))

    return MemoryLogger()
