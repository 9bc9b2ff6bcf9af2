"""`astrai.train.wandb_logger`: W&B runs start without wandb's "anonymous setting has no
effect" warning, which Lightning's logger triggers by always passing `anonymous` (#54.11)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from train_helpers import REPO


@pytest.mark.slow  # a subprocess starting an offline W&B run
def test_an_offline_run_starts_without_the_anonymous_warning(tmp_path: Path) -> None:
    code = (
        "import wandb\n"
        "from astrai.train.wandb_run import wandb_logger\n"
        f"lg = wandb_logger(mode='offline', project='p', name='n', save_dir={str(tmp_path)!r})\n"
        "print('run', lg.experiment.id)\n"
        "wandb.finish()\n"
    )
    env = {**os.environ, "WANDB_MODE": "offline", "WANDB_DIR": str(tmp_path)}
    p = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, env=env, timeout=180
    )
    assert p.returncode == 0 and "run " in p.stdout, p.stderr[-2000:]
    assert "anonymous" not in p.stderr.lower(), p.stderr[-2000:]
