"""Fixtures for the training tests.

Tokenizers and prepared data are cached for the whole session in one data dir (their cache
key includes the settings, and astrai locks each build), so each is built once, shared by the
xdist workers too; every run writes under its own tmp_path. The uninterrupted reference runs
that the resume, interrupt and replay tests compare against are trained once per session by
`reference_run`.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
from train_helpers import cli, run_dirs

from astrai.data.cache import digest


@pytest.fixture(scope="session")
def data_dir(shared_dir: Path) -> Path:
    path = shared_dir / "astrai-data"
    path.mkdir(exist_ok=True)
    return path


@pytest.fixture(scope="session")
def reference_run(shared_build, data_dir: Path) -> Callable[..., Path]:
    """`reference_run(label, args, env=None)`: the run folder of `python -m astrai.train
    ARGS` (with the session's data dir), trained once per session for each distinct
    `args` and `env`, whichever test asks first. Shared: read it, or copy it to change it."""

    def run(label: str, args: list[str], env: dict[str, str] | None = None) -> Path:
        def build(where: Path) -> None:
            cli([*args, *run_dirs(where, data_dir)], env=env)

        return shared_build(f"{label}-{digest([args, env])}", build) / "run"

    return run
