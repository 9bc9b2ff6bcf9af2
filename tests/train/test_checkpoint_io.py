"""Checkpoint files on disk: a full disk while one is written, their mode, the temporary
files of killed writes, and `save_top_k` across launches of one run folder."""

from __future__ import annotations

import errno
import io
import os
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from train_helpers import REPO, SMALL, TINY_MODEL, cli, run_dirs

import astrai.train.checkpoint_io as checkpoint_io
from astrai.files import DiskFullError
from astrai.train.checkpoint import is_complete
from astrai.train.checkpoint_io import AtomicCheckpointIO


class _FillingDisk(io.FileIO):
    """A file on a disk with `room` bytes left: what the kernel does when it fills, a short
    write, then `ENOSPC`."""

    room = 5000

    def write(self, data) -> int:
        n = min(len(memoryview(data)), _FillingDisk.room)
        if n == 0:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        _FillingDisk.room -= n
        return super().write(memoryview(data)[:n])


def test_a_full_disk_is_one_line_naming_the_file_and_keeps_the_last_checkpoint(
    tmp_path, monkeypatch
):
    """Before: torch's zip writer turned the short write into "[enforce fail at
    inline_container.cc] unexpected pos", naming neither the file nor the full disk."""
    io_, path = AtomicCheckpointIO(), tmp_path / "checkpoints" / "last.ckpt"
    io_.save_checkpoint({"global_step": 1, "w": torch.zeros(10)}, path)
    monkeypatch.setattr(
        checkpoint_io,
        "open",
        lambda file, mode: _FillingDisk(file, "wb"),
        raising=False,
    )
    with pytest.raises(DiskFullError) as err:
        io_.save_checkpoint({"global_step": 2, "w": torch.zeros(100_000)}, path)
    monkeypatch.undo()
    assert str(err.value) == (
        f"{path}: No space left on device (the checkpoints already in {path.parent} are intact)"
    )
    assert torch.load(path)["global_step"] == 1 and is_complete(path)
    assert sorted(p.name for p in path.parent.iterdir()) == ["last.ckpt"]  # no temporary file


def test_checkpoints_get_the_umask_mode(tmp_path):
    old = os.umask(0o027)
    try:
        path = tmp_path / "last.ckpt"
        AtomicCheckpointIO().save_checkpoint({"global_step": 1}, path)
    finally:
        os.umask(old)
    assert stat.S_IMODE(path.stat().st_mode) == 0o640


# ---------------------------------------------------------------------- the CLI
RUN = [
    *TINY_MODEL,
    *SMALL,
    "callbacks.progress_bar=null",
    "trainer.enable_model_summary=false",
    "trainer.val_check_interval=4",
    "trainer.limit_val_batches=1",
    "callbacks.model_checkpoint.every_n_train_steps=2",
    "data.batch_size=8",
]


def _step(path: Path) -> int:
    return torch.load(path, map_location="cpu", weights_only=False)["global_step"]


@pytest.mark.slow
def test_launches_of_one_run_folder_prune_stale_files_and_stop_on_a_full_disk(tmp_path, data_dir):
    """Three launches in one run folder (`hydra.run.dir`, as a requeued job has):
    the second removes the temporary file a killed write left and, with save_top_k=1, the
    step checkpoint an older launch left behind (Lightning forgets files it did not write
    itself); the third hits a full disk while writing a checkpoint: one line naming the file
    and `No space left on device`, a failed status, and last.ckpt still whole."""
    run = [*RUN, *run_dirs(tmp_path, data_dir)]
    cli([*run, "trainer.max_steps=4"])
    ckpts = tmp_path / "run" / "checkpoints"
    assert sorted(p.name for p in ckpts.iterdir()) == ["last.ckpt", "step000004.ckpt"]
    # an older launch's step checkpoint (killed between writing it and pruning) and the
    # temporary file of a killed write
    older = ckpts / "step000002.ckpt"
    older.write_bytes((ckpts / "step000004.ckpt").read_bytes())
    os.utime(older, (time.time() - 3600,) * 2)
    stale = ckpts / f".last.ckpt.tmp{2**22 + 4321}"  # no such process
    stale.write_bytes(b"half a checkpoint")

    resumed = cli([*run, "trainer.max_steps=6", "ckpt_path=last"])
    assert sorted(p.name for p in ckpts.iterdir()) == ["last.ckpt", "step000006.ckpt"]
    assert f"removed {stale}" in resumed.stdout + resumed.stderr

    # the third launch's write of step000008.ckpt lands on a full device (/dev/full)
    proc = subprocess.Popen(
        [sys.executable, "-m", "astrai.train", *run, "trainer.max_steps=8", "ckpt_path=last"],
        cwd=REPO,
        env={**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "offline"},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    (ckpts / f".step000008.ckpt.tmp{proc.pid}").symlink_to("/dev/full")
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 1, (out + err)[-3000:]
    last_line = err.strip().splitlines()[-1]
    assert last_line == (
        f"astrai.train: {ckpts / 'step000008.ckpt'}: No space left on device "
        f"(the checkpoints already in {ckpts} are intact)"
    )
    assert "Traceback" not in err
    assert _step(ckpts / "last.ckpt") == 6 and is_complete(ckpts / "last.ckpt")
    assert sorted(p.name for p in ckpts.iterdir()) == ["last.ckpt", "step000006.ckpt"]
