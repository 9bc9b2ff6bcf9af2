"""Test-only Lightning callbacks, loaded by `python -m astrai.train` runs through
`+callbacks.<name>._target_=_callbacks.<Class>` with this folder on PYTHONPATH."""

from __future__ import annotations

import os
import signal

import torch
from lightning.pytorch.callbacks import Callback


class KillAtStep(Callback):
    """SIGKILL this process in the middle of optimizer step `step` (after backward, before
    the weights change): nothing gets to clean up, as with an OOM kill or a lost node."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        if trainer.global_step == self.step:
            os.kill(os.getpid(), signal.SIGKILL)


class NaNAtStep(Callback):
    """Poison one weight with NaN just before training step `step`."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_step == self.step:
            with torch.no_grad():
                pl_module.model.embed_tokens.weight[:] = float("nan")


class KillInValidation(Callback):
    """SIGKILL this process in the middle of the validation that follows training step
    `step` (the checkpoint of that step is already written)."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_validation_batch_start(self, trainer, pl_module, *args, **kwargs) -> None:
        if trainer.global_step == self.step and not trainer.sanity_checking:
            os.kill(os.getpid(), signal.SIGKILL)
