"""Helpers for the training tests: small settings and `python -m astrai.train` runs."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

# small settings shared by the CLI tests (the cache key includes them: one build per session)
SMALL = [
    "tokenizer.train.max_bytes=400000",
    "data.train.prepare.builtin.max_bytes=300000",
    "data.val.prepare.builtin.max_bytes=60000",
]
TINY_MODEL = ["model=tiny", "tokenizer.train.vocab_size=512"]


def run_dirs(tmp: Path, data_dir: Path) -> list[str]:
    """Overrides that keep a run's outputs under `tmp` and share the session's data cache."""
    return [
        f"paths.data_dir={data_dir}",
        f"paths.log_dir={tmp / 'outputs'}",
        f"hydra.run.dir={tmp / 'run'}",
        f"hydra.sweep.dir={tmp / 'multirun'}",
    ]


def cli(
    args: list[str], *, timeout: float = 300, check: bool = True, env: dict | None = None
) -> subprocess.CompletedProcess:
    """`python -m astrai.train ARGS` in a subprocess (W&B offline, no network); `env` adds
    variables to the current environment."""
    full_env = {**os.environ, "WANDB_MODE": "offline", "HF_HUB_OFFLINE": "1", **(env or {})}
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
