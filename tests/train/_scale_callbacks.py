"""Test-only callbacks for the scale-out tests (FSDP on CPU, resume at another world size),
loaded by `python -m astrai.train` through `+callbacks.<name>._target_=_scale_callbacks.<Class>`
with this folder on PYTHONPATH."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from lightning.pytorch.callbacks import Callback


class GlobalLoss(Callback):
    """Append every optimizer step's training loss, averaged over all ranks (the loss of the
    whole global batch when every rank's batch has as many tokens), to the JSON-lines file
    `path` from rank 0: `train/loss` in the CSV log is rank 0's half only. A resumed run
    appends to the same file; each line also records the world size that computed it and a
    digest of every sample of the global batch (sorted), so a test sees which samples each
    step trained on, whatever the number of ranks."""

    def __init__(self, path: str) -> None:
        self.path = Path(path)

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, *args: Any) -> None:
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs
        mean = trainer.strategy.reduce(loss.detach().clone(), reduce_op="mean")
        batch = args[0]
        ids = trainer.strategy.all_gather(batch["input_ids"]).reshape(
            -1, batch["input_ids"].shape[-1]
        )
        if trainer.is_global_zero:
            samples = sorted(hashlib.sha1(r.cpu().numpy().tobytes()).hexdigest()[:12] for r in ids)
            row = {
                "step": trainer.global_step,
                "loss": float(mean),
                "world": trainer.world_size,
                "samples": samples,
            }
            with open(self.path, "a") as fh:
                fh.write(json.dumps(row) + "\n")
