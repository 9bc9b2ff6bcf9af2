"""`SharedBuild` (tests/shared_build.py): the suite's expensive folders are built once per
session even when two xdist workers ask at once, and a build that failed is done again."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
from shared_build import SharedBuild


def test_two_askers_at_once_get_one_build(tmp_path: Path) -> None:
    shared, builds, got = SharedBuild(tmp_path), [], []

    def build(where: Path) -> None:
        builds.append(where)
        time.sleep(0.3)  # the other asker arrives while this one builds
        (where / "made").write_text("once")

    askers = [threading.Thread(target=lambda: got.append(shared("run", build))) for _ in "ab"]
    for t in askers:
        t.start()
    for t in askers:
        t.join()
    assert builds == [tmp_path / "run"] and got == [tmp_path / "run"] * 2
    assert (tmp_path / "run" / "made").read_text() == "once"
    assert shared("run", build) == tmp_path / "run" and len(builds) == 1  # later: reused


def test_a_failed_build_is_built_again_from_an_empty_folder(tmp_path: Path) -> None:
    shared = SharedBuild(tmp_path)

    def failing(where: Path) -> None:
        (where / "half").write_text("cut short")
        raise RuntimeError("the run failed")

    with pytest.raises(RuntimeError, match="the run failed"):
        shared("run", failing)
    seen = []
    where = shared("run", lambda w: seen.append(sorted(p.name for p in w.iterdir())))
    assert seen == [[]] and where == tmp_path / "run"
