"""The training progress bar: Lightning's tqdm bar, counting optimizer steps when the run
is bounded by steps.

Lightning's bars count batches per epoch, which says nothing useful about a `max_steps` run
(most LLM runs): `Epoch 0: 70/?` on an iterable dataset, `Epoch 0/-2` on the rich bar, and
a count restarted at 0 after a resume. This bar shows `step 120/1500` from the resumed step
on, with the rate and the time left over the steps this process ran. It is built in
`on_train_start` (`init_train_tqdm`): Lightning (2.6) skips `on_train_epoch_start` when a
run resumes mid-epoch.

With a mixture of training sources (``data.train.sources``) the bar's figures also count the
samples each source gave so far (``samples/<name>``, all ranks, since the run's start).
"""

from __future__ import annotations

import sys
from typing import Any

import lightning as L
from lightning.pytorch.callbacks import TQDMProgressBar
from lightning.pytorch.callbacks.progress.tqdm_progress import Tqdm

from astrai.data.datamodule import AstraiDataModule

__all__ = ["StepProgressBar", "source_counts"]

STEP_FORMAT = "step {n_fmt}/{total_fmt} {percentage:3.0f}%|{bar}| [{elapsed}<{remaining}, {rate_fmt}{postfix}]"


def bounded_by_steps(trainer: L.Trainer) -> bool:
    """The run ends at `trainer.max_steps` (not after a number of epochs)."""
    return trainer.max_steps is not None and trainer.max_steps > 0


def source_counts(datamodule: Any) -> dict[str, int]:
    """``{"samples/<name>": count}`` for each ``data.train.sources`` entry (empty for one)."""
    if not isinstance(datamodule, AstraiDataModule):
        return {}
    return {f"samples/{name}": n for name, n in datamodule.source_counts().items()}


class StepProgressBar(TQDMProgressBar):
    """`step N/max_steps` when `trainer.max_steps` is set (epochs as Lightning's bar else)."""

    def init_train_tqdm(self) -> Tqdm:
        """The bar counts steps from its first frame (no `Training: 0/?` before it). Lightning
        builds it in `on_train_start`, which also runs when a run resumes mid-epoch, unlike
        `on_train_epoch_start` (skipped then by Lightning 2.6)."""
        trainer = self.trainer
        if not bounded_by_steps(trainer):
            return super().init_train_tqdm()
        return Tqdm(
            total=trainer.max_steps,
            initial=trainer.global_step,  # a resumed run: the rate counts this run's steps
            unit="step",
            bar_format=STEP_FORMAT,
            position=2 * self.process_position,
            disable=self.is_disabled,
            leave=True,
            dynamic_ncols=True,
            file=sys.stdout,
            smoothing=0,
        )

    def get_metrics(
        self, trainer: L.Trainer, pl_module: L.LightningModule
    ) -> dict[str, int | str | float | dict[str, float]]:
        """Lightning's figures, and each training source's sample count (a mixture's)."""
        metrics = super().get_metrics(trainer, pl_module)
        metrics.update(source_counts(trainer.datamodule))
        return metrics

    def on_train_epoch_start(self, trainer: L.Trainer, *args: Any) -> None:
        if not bounded_by_steps(trainer):
            super().on_train_epoch_start(trainer, *args)
            return
        self._show(trainer, trainer.global_step)

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, idx: int
    ) -> None:
        if not bounded_by_steps(trainer):
            super().on_train_batch_end(trainer, pl_module, outputs, batch, idx)
            return
        step, bar = trainer.global_step, self.train_progress_bar
        due = step % self.refresh_rate == 0 or step == trainer.max_steps
        if self.is_enabled and due and step != bar.n:  # accumulation: once per optimizer step
            bar.n = step
            bar.set_postfix(self.get_metrics(trainer, pl_module))

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not bounded_by_steps(trainer):
            super().on_train_epoch_end(trainer, pl_module)
        elif not self.train_progress_bar.disable:
            self.train_progress_bar.set_postfix(self.get_metrics(trainer, pl_module))

    def _show(self, trainer: L.Trainer, step: int) -> None:
        bar = self.train_progress_bar
        if not bar.disable:
            bar.n = step
            bar.refresh()
