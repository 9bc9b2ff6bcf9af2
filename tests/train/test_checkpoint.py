"""Checkpoint files a kill cannot leave half-written, and the completeness check that
`ckpt_path=last` relies on (fast, no training)."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest
import torch

from astrai.train import runner
from astrai.train.checkpoint import is_complete, newest_complete
from astrai.train.checkpoint_io import AtomicCheckpointIO
from astrai.train.runner import ConfigPathError, IncompleteCheckpointError


def _save(path: Path, step: int, mtime: float | None = None) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"global_step": step, "w": torch.arange(step + 1.0)}, path)
    if mtime is not None:
        os.utime(path, (mtime, mtime))
    return path


def test_a_write_killed_midway_keeps_the_previous_file(tmp_path, monkeypatch):
    io, path = AtomicCheckpointIO(), tmp_path / "ckpt" / "last.ckpt"
    io.save_checkpoint({"global_step": 1}, path)
    assert is_complete(path) and torch.load(path)["global_step"] == 1

    def dies_midway(obj, fh, *args, **kwargs):
        fh.write(b"PK\x03\x04 half a checkpoint")
        raise KeyboardInterrupt  # the process is stopped in the middle of the write

    monkeypatch.setattr(torch, "save", dies_midway)
    with pytest.raises(KeyboardInterrupt):
        io.save_checkpoint({"global_step": 2}, path)
    monkeypatch.undo()
    assert torch.load(path)["global_step"] == 1  # the previous checkpoint, whole
    assert sorted(p.name for p in path.parent.iterdir()) == ["last.ckpt"]  # no leftovers


def test_is_complete(tmp_path):
    good = _save(tmp_path / "good.ckpt", 3)
    assert is_complete(good)
    cut = tmp_path / "cut.ckpt"
    cut.write_bytes(good.read_bytes()[: good.stat().st_size // 2])
    assert not is_complete(cut)
    (tmp_path / "text.ckpt").write_text("not a checkpoint")
    assert not is_complete(tmp_path / "text.ckpt") and not is_complete(tmp_path / "nope.ckpt")
    sharded = tmp_path / "sharded.ckpt"  # torch.distributed.checkpoint writes .metadata last
    sharded.mkdir()
    assert not is_complete(sharded)
    (sharded / ".metadata").write_bytes(b"x")
    assert is_complete(sharded)


def test_newest_complete_skips_and_names_cut_short_files(tmp_path, caplog):
    old = _save(tmp_path / "a.ckpt", 2, mtime=1_000)
    new = _save(tmp_path / "b.ckpt", 4, mtime=2_000)
    new.write_bytes(new.read_bytes()[:100])
    with caplog.at_level(logging.WARNING):
        assert newest_complete([old, new]) == old
    assert f"checkpoint {new} is incomplete" in caplog.text
    assert newest_complete([new]) is None


def test_resolve_ckpt_path_last(tmp_path, caplog) -> None:
    logs, out = tmp_path / "outputs", tmp_path / "run"
    assert runner.resolve_ckpt_path(None, out, logs, "x") is None
    assert runner.resolve_ckpt_path("last", out, logs, "x") is None  # fresh start
    other = _save(logs / "x" / "2026-01-01_00-00-00" / "checkpoints" / "last.ckpt", 9)
    assert runner.resolve_ckpt_path("last", out, logs, "x") == other  # newest of the experiment
    periodic = _save(out / "checkpoints" / "step000002.ckpt", 2)
    assert runner.resolve_ckpt_path("last", out, logs, "x") == periodic  # this run's own first
    own = _save(out / "checkpoints" / "last.ckpt", 4)
    assert runner.resolve_ckpt_path("last", out, logs, "x") == own
    own.write_bytes(own.read_bytes()[:64])  # cut short: the run's newest whole one instead
    with caplog.at_level(logging.INFO):
        assert runner.resolve_ckpt_path("last", out, logs, "x") == periodic
    assert f"checkpoint {own} is incomplete" in caplog.text
    with pytest.raises(ConfigPathError, match="ckpt_path"):
        runner.resolve_ckpt_path(tmp_path / "nope.ckpt", out, logs, "x")
    with pytest.raises(
        IncompleteCheckpointError, match=r"ckpt_path: .*last\.ckpt is not a complete"
    ):
        runner.resolve_ckpt_path(own, out, logs, "x")


def test_resolve_ckpt_path_last_picks_an_interruption_checkpoint_when_newest(tmp_path) -> None:
    """`InterruptCheckpoint` writes `interrupted.ckpt` after the periodic `last.ckpt`: `last`
    resumes from it, here or from another run folder of the experiment; once the resumed run
    has written a newer `last.ckpt`, a stale `interrupted.ckpt` no longer wins."""
    logs, out = tmp_path / "outputs", tmp_path / "run"
    _save(out / "checkpoints" / "step000005.ckpt", 5, mtime=1_000)
    _save(out / "checkpoints" / "last.ckpt", 5, mtime=1_000)
    stop = _save(out / "checkpoints" / "interrupted.ckpt", 7, mtime=2_000)
    assert runner.resolve_ckpt_path("last", out, logs, "x") == stop
    elsewhere = _save(logs / "x" / "a" / "checkpoints" / "interrupted.ckpt", 3, mtime=3_000)
    assert runner.resolve_ckpt_path("last", tmp_path / "new", logs, "x") == elsewhere
    later = _save(out / "checkpoints" / "last.ckpt", 10, mtime=4_000)
    assert runner.resolve_ckpt_path("last", out, logs, "x") == later
