"""Checkpoint files a kill cannot leave half-written, and the completeness check that
`ckpt_path=last` relies on (fast, no training)."""

from __future__ import annotations

import logging
import os
import struct
import zipfile
from pathlib import Path

import pytest
import torch

from astrai.train import runner
from astrai.train.checkpoint import (
    LIGHTNING_META,
    checkpoint_problem,
    is_complete,
    newest_complete,
    remove_stale_temps,
    temp_name,
)
from astrai.train.checkpoint_io import AtomicCheckpointIO
from astrai.train.runner import (
    BrokenCheckpointsError,
    ConfigPathError,
    IncompleteCheckpointError,
)


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


def _zero_inside(path: Path, member_suffix: str = "data/0") -> None:
    """Zero up to 64 bytes in the middle of a member's data (bit rot, a bad copy): the file
    keeps its size and zip directory."""
    with zipfile.ZipFile(path) as archive:
        info = next(i for i in archive.infolist() if i.filename.endswith(member_suffix))
    with open(path, "r+b") as fh:
        fh.seek(info.header_offset + 26)  # the local header's name and extra-field lengths
        name_len, extra_len = struct.unpack("<HH", fh.read(4))
        data = info.header_offset + 30 + name_len + extra_len
        n = min(64, info.compress_size // 2)
        fh.seek(data + (info.compress_size - n) // 2)
        fh.write(b"\0" * n)


def test_checkpoint_problem_names_cut_short_damaged_and_foreign_files(tmp_path):
    good = _save(tmp_path / "good.ckpt", 3000)
    assert is_complete(good) and checkpoint_problem(good) is None
    cut = tmp_path / "cut.ckpt"
    cut.write_bytes(good.read_bytes()[: good.stat().st_size // 2])
    assert checkpoint_problem(cut).startswith("cut short")
    (tmp_path / "text.ckpt").write_text("not a checkpoint")
    assert not is_complete(tmp_path / "text.ckpt") and not is_complete(tmp_path / "nope.ckpt")
    # the zip directory is whole, the data is not: only the CRC of every member tells
    _zero_inside(good)
    assert checkpoint_problem(good).startswith("damaged: member ")
    assert "data/0" in checkpoint_problem(good)


def test_a_checkpoint_is_verified_once_per_version(tmp_path, caplog):
    path = _save(tmp_path / "a.ckpt", 3)
    with caplog.at_level(logging.INFO, logger="astrai.train.checkpoint"):
        assert is_complete(path) and is_complete(path)
        assert caplog.text.count(f"checkpoint {path} verified (CRC-32 of") == 1
        _save(path, 4, mtime=5_000)  # a new version of the file is verified again
        assert is_complete(path)
        assert caplog.text.count(f"checkpoint {path} verified (CRC-32 of") == 2


def test_sharded_checkpoint_folders_are_verified_as_far_as_they_can_be(tmp_path):
    """A `torch.distributed.checkpoint` folder has no checksums: its `.metadata` must load,
    every shard file it lists be there and long enough, and Lightning's meta.pt be whole."""
    import torch.distributed.checkpoint as dcp

    folder = tmp_path / "last.ckpt"
    dcp.save({"w": torch.arange(4096.0), "b": torch.ones(8)}, checkpoint_id=str(folder))
    _save(folder / LIGHTNING_META, 2)
    assert checkpoint_problem(folder) is None
    [shard] = folder.glob("*.distcp")
    whole = shard.read_bytes()
    shard.write_bytes(whole[:100])
    assert checkpoint_problem(folder) == (
        f"cut short: shard file {shard.name} holds 100 of {len(whole)} bytes"
    )
    shard.unlink()
    assert checkpoint_problem(folder) == f"incomplete: shard file {shard.name} is missing"
    shard.write_bytes(whole)
    _zero_inside(folder / LIGHTNING_META, "data.pkl")
    assert checkpoint_problem(folder).startswith(f"{LIGHTNING_META}: damaged")
    (folder / ".metadata").write_bytes(b"x")
    assert checkpoint_problem(folder).startswith("damaged: its .metadata cannot be read")
    (folder / ".metadata").unlink()
    assert checkpoint_problem(folder).startswith("cut short")


def test_newest_complete_skips_and_names_cut_short_files(tmp_path, caplog):
    old = _save(tmp_path / "a.ckpt", 2, mtime=1_000)
    new = _save(tmp_path / "b.ckpt", 4, mtime=2_000)
    new.write_bytes(new.read_bytes()[:100])
    with caplog.at_level(logging.WARNING):
        assert newest_complete([old, new]) == old
    assert f"checkpoint {new} is cut short" in caplog.text
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
    assert f"checkpoint {own} is cut short" in caplog.text
    with pytest.raises(ConfigPathError, match="ckpt_path"):
        runner.resolve_ckpt_path(tmp_path / "nope.ckpt", out, logs, "x")
    with pytest.raises(IncompleteCheckpointError, match=r"ckpt_path: .*last\.ckpt is cut short"):
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


def test_last_never_falls_back_to_another_run_when_this_runs_checkpoints_are_broken(
    tmp_path, caplog
) -> None:
    """Before: with every checkpoint of the run folder cut short, `last` resumed the newest
    whole checkpoint of the experiment, another run's weights under this run's config."""
    logs, out = tmp_path / "outputs", tmp_path / "outputs" / "x" / "run_b"
    _save(logs / "x" / "run_a" / "checkpoints" / "last.ckpt", 9, mtime=1_000)
    for name in ("last.ckpt", "step000004.ckpt"):
        cut = _save(out / "checkpoints" / name, 4, mtime=2_000)
        cut.write_bytes(cut.read_bytes()[:64])
    with pytest.raises(BrokenCheckpointsError) as err:
        runner.resolve_ckpt_path("last", out, logs, "x")
    message = str(err.value)
    assert f"every checkpoint of run {out} is broken" in message
    assert "last.ckpt (cut short" in message and "step000004.ckpt (cut short" in message
    assert "run_a" not in message and "\n" not in message


def test_last_from_a_new_folder_takes_the_newest_run_whole_or_stops(tmp_path) -> None:
    """From a new run folder, `last` resumes the newest run of the experiment: its newest
    whole checkpoint, or an error naming its broken ones (never an older run's)."""
    logs, new = tmp_path / "outputs", tmp_path / "outputs" / "x" / "new"
    older = _save(logs / "x" / "a" / "checkpoints" / "last.ckpt", 3, mtime=1_000)
    step = _save(logs / "x" / "b" / "checkpoints" / "step000002.ckpt", 2, mtime=2_000)
    last = _save(logs / "x" / "b" / "checkpoints" / "last.ckpt", 4, mtime=3_000)
    assert runner.resolve_ckpt_path("last", new, logs, "x") == last
    _zero_inside(last)
    assert runner.resolve_ckpt_path("auto", new, logs, "x") == step
    step.write_bytes(step.read_bytes()[:10])
    with pytest.raises(BrokenCheckpointsError, match=r"ckpt_path=last: every checkpoint of run"):
        runner.resolve_ckpt_path("last", new, logs, "x")
    assert older.exists()


def test_temporary_files_of_killed_writes_are_removed(tmp_path, caplog) -> None:
    folder = tmp_path / "checkpoints"
    folder.mkdir()
    dead = 2**22 + 12345  # above the default pid_max (32768 / 4194304): no such process
    stale = folder / f".last.ckpt.tmp{dead}"
    stale.write_bytes(b"x" * 1000)
    live = temp_name(folder / "last.ckpt")  # this process's: a write in progress
    live.write_bytes(b"y")
    keep = _save(folder / "last.ckpt", 1)
    with caplog.at_level(logging.WARNING):
        assert remove_stale_temps(folder) == [stale]
    assert f"removed {stale}" in caplog.text
    assert sorted(p.name for p in folder.iterdir()) == sorted([live.name, keep.name])
