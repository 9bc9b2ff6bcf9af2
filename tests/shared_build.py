"""`SharedBuild`: an expensive folder (a reference training run) built once per test session,
across pytest-xdist workers (tests/conftest.py's `shared_build` fixture)."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path


class SharedBuild:
    """Builds each named folder once per session, whichever worker asks first: it builds
    under a file lock while the others wait, then all reuse it. What it hands out is shared
    by the tests of every worker: read it, or copy it to change it."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def __call__(self, name: str, build: Callable[[Path], None]) -> Path:
        from astrai.data.cache import file_lock  # imported late: astrai after conftest's set-up

        where, done = self.root / name, self.root / f"{name}.done"
        with file_lock(self.root / f"{name}.lock"):
            if not done.exists():
                shutil.rmtree(where, ignore_errors=True)  # a build that failed part-way
                where.mkdir(parents=True)
                build(where)
                done.touch()
        return where
