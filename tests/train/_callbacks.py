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


class SignalAtStep(Callback):
    """Send signal `signame` (SIGTERM, SIGINT) to this process in the middle of optimizer step
    `step` (after backward, before the weights change), or with `in_validation` in the middle
    of the validation that follows step `step`: a graceful stop must still finish the step
    (and write a checkpoint after it). Every validation batch draws from the global RNG, as
    sampling-based evaluation does: a stop during validation must not save that state."""

    def __init__(self, step: int, signame: str = "SIGTERM", in_validation: bool = False) -> None:
        self.step, self.in_validation = step, in_validation
        self.signum = getattr(signal, signame)
        self.sent = False

    def _send(self) -> None:
        if not self.sent:
            self.sent = True
            os.kill(os.getpid(), self.signum)

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        if not self.in_validation and trainer.global_step == self.step:
            self._send()

    def on_validation_batch_start(self, trainer, pl_module, *args, **kwargs) -> None:
        torch.rand(1)
        if self.in_validation and trainer.global_step == self.step and not trainer.sanity_checking:
            self._send()
