"""`AtomicCheckpointIO`: checkpoint files that a kill or a full disk cannot leave half-written.

The trainer's `plugins` (conf/trainer/default.yaml). Each local checkpoint is written under a
temporary name in its own folder (`.<name>.tmp<pid>`), synced, and renamed into place
(`os.replace` is atomic on one filesystem), so a run killed mid-write keeps the previous file
intact and a file named `*.ckpt` is always whole. The temporary file of a killed write is
removed at the next start (`astrai.train.checkpoint.remove_stale_temps`). A full disk stops
the run with one line naming the file (`astrai.files.DiskFullError`); the previous
checkpoint stays whole. Remote paths go through Lightning's own writer.

A sharded checkpoint (a `torch.distributed.checkpoint` folder written by `trainer=fsdp2` or
`trainer=fsdp`) is not a file this plugin can read: resuming one under a strategy that loads
single files (one process, DDP) stops with an error that names the way to resume it.

`RunCheckpoint` is Lightning's `ModelCheckpoint` whose `save_top_k=1` keeps one step
checkpoint per run folder across launches too.
"""

from __future__ import annotations

import logging
import os
import re
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
from lightning.pytorch.callbacks import ModelCheckpoint

from astrai.files import naming_full_disk, publish
from astrai.train.checkpoint import temp_name

log = logging.getLogger(__name__)

__all__ = ["AtomicCheckpointIO", "RunCheckpoint", "ShardedCheckpointError"]


class ShardedCheckpointError(ValueError):
    """`ckpt_path` is a sharded checkpoint folder and the trainer's strategy reads single files."""


class AtomicCheckpointIO(TorchCheckpointIO):
    """`TorchCheckpointIO` whose local writes are a temporary file, fsync, `os.replace`."""

    def save_checkpoint(
        self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None
    ) -> None:
        if storage_options is not None or "://" in str(path):  # remote: Lightning's own way
            super().save_checkpoint(checkpoint, path, storage_options)
            return
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = temp_name(path)
        kept = f"the checkpoints already in {path.parent} are intact"
        try:
            # on a full disk torch raises "unexpected pos" with the OSError as its context
            with naming_full_disk(path, kept), open(tmp, "wb") as fh:
                torch.save(checkpoint, fh)
                fh.flush()
                os.fsync(fh.fileno())
            publish(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)

    def load_checkpoint(self, path: Any, *args: Any, **kwargs: Any) -> dict[str, Any]:
        if "://" not in str(path) and Path(path).is_dir():
            raise ShardedCheckpointError(
                f"ckpt_path: {path} is a sharded checkpoint (a torch.distributed.checkpoint "
                "folder, one shard per rank), which trainer.strategy cannot load; resume it with "
                "trainer=fsdp2 (any trainer.devices and trainer.num_nodes: the shards are "
                "resharded to the new world size), or convert it to one file with "
                "`python -m torch.distributed.checkpoint.format_utils dcp_to_torch "
                f"{path} <file>` and load only the weights from it"
            )
        return super().load_checkpoint(path, *args, **kwargs)


class RunCheckpoint(ModelCheckpoint):
    """`ModelCheckpoint` whose `save_top_k=1` without a `monitor` (keep the newest) also prunes
    the step checkpoints that older launches of the run left in `dirpath`.

    Lightning removes only the file it saved last; it never learns of one written by a
    launch killed between saving a step checkpoint and removing the one before, so in a run
    folder that is resumed again and again (`hydra.run.dir`, a requeued job) those pile up.
    Here every save of a step checkpoint also removes the older files in `dirpath` that its
    `filename` pattern names; `last.ckpt`, the checkpoint the run resumed from and newer
    files (a run resumed from an earlier checkpoint) are never touched.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._pruned_for: str | None = None  # the newest checkpoint the folder was pruned for

    def _monitor_candidates(self, trainer: L.Trainer) -> dict[str, torch.Tensor]:
        """The file name's `step` is always the optimizer step whose weights the file holds.
        Lightning takes a logged metric named `step` first (`ValidationStep` logs the
        validation's step index that way), which would name a later checkpoint after the
        last validation."""
        candidates = super()._monitor_candidates(trainer)
        candidates["step"] = torch.tensor(trainer.global_step)
        return candidates

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any, **kwargs: Any) -> None:
        super().on_train_batch_end(trainer, *args, **kwargs)
        self._prune(trainer)

    def on_train_epoch_end(self, trainer: L.Trainer, *args: Any, **kwargs: Any) -> None:
        super().on_train_epoch_end(trainer, *args, **kwargs)
        self._prune(trainer)

    def on_validation_end(self, trainer: L.Trainer, *args: Any, **kwargs: Any) -> None:
        super().on_validation_end(trainer, *args, **kwargs)
        self._prune(trainer)

    def _prune(self, trainer: L.Trainer) -> None:
        if self.save_top_k != 1 or self.monitor is not None or self.dirpath is None:
            return
        if not trainer.is_global_zero or self.best_model_path in ("", self._pruned_for):
            return
        self._pruned_for = self.best_model_path
        kept, folder = Path(self.best_model_path), Path(self.dirpath)
        if not kept.exists() or folder.resolve() not in kept.resolve().parents:
            return  # e.g. the checkpoint of another run folder this launch resumed from
        template = self.filename or "{epoch}-{step}"
        fields = re.split(r"\{[^}]*\}", template)
        pattern = re.compile(
            ".+".join(map(re.escape, fields)) + r"(-v\d+)?" + re.escape(self.FILE_EXTENSION)
        )
        resumed = Path(trainer.ckpt_path).resolve() if trainer.ckpt_path else None
        newest = kept.stat().st_mtime
        for path in folder.iterdir():
            if (
                path.resolve() in (kept.resolve(), resumed)
                or not pattern.fullmatch(path.name)
                or path.name.startswith(self.CHECKPOINT_NAME_LAST or "last")
                or path.stat().st_mtime >= newest
            ):
                continue
            trainer.strategy.remove_checkpoint(path)
            log.info("removed %s, an older step checkpoint of this run (save_top_k=1)", path)
