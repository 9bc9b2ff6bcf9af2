"""`AtomicCheckpointIO`: checkpoint files that a kill cannot leave half-written.

The trainer's `plugins` (conf/trainer/default.yaml). Each local checkpoint is written under a
temporary name in its own folder, synced, and renamed into place (`os.replace` is atomic on
one filesystem), so a run killed mid-write keeps the previous file intact and a file named
`*.ckpt` is always whole. Remote paths go through Lightning's own writer.

A sharded checkpoint (a `torch.distributed.checkpoint` folder written by `trainer=fsdp2` or
`trainer=fsdp`) is not a file this plugin can read: resuming one under a strategy that loads
single files (one process, DDP) stops with an error that names the way to resume it.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO

__all__ = ["AtomicCheckpointIO", "ShardedCheckpointError"]


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
        tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
        try:
            with open(tmp, "wb") as fh:
                torch.save(checkpoint, fh)
                fh.flush()
                os.fsync(fh.fileno())
            os.replace(tmp, path)
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
