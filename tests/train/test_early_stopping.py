"""conf/callbacks/early_stopping*: composed into the training config both ways, and the
callback it builds stops a run at the step a fixed metric sequence implies."""

from __future__ import annotations

import lightning as L
import pytest
import torch
from hydra.utils import instantiate
from torch.utils.data import DataLoader, TensorDataset

from astrai.train.runner import compose

VAL_EVERY = 2  # optimizer steps between validations


class Scripted(L.LightningModule):
    """Trains a scalar; each validation logs the next value of `metrics` as `name`."""

    def __init__(self, name: str, metrics: list[float]) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(1))
        self.name, self.metrics, self.validations = name, metrics, 0

    def training_step(self, batch, batch_idx):
        return (self.w - batch[0]).pow(2).mean()

    def validation_step(self, batch, batch_idx):
        pass

    def on_validation_epoch_end(self) -> None:
        if self.trainer.sanity_checking:
            return
        self.log(self.name, self.metrics[self.validations])
        self.validations += 1

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _stopping(overrides: list[str]):
    cfg = compose([*overrides, "paths.output_dir=/tmp/astrai-early-stopping"])
    return cfg, instantiate(cfg.callbacks.early_stopping)


def _fit(callback, module: Scripted, max_steps: int = 40) -> L.Trainer:
    data = DataLoader(TensorDataset(torch.ones(200)), batch_size=1)
    trainer = L.Trainer(
        accelerator="cpu",
        max_steps=max_steps,
        val_check_interval=VAL_EVERY,
        limit_val_batches=1,
        num_sanity_val_steps=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[callback],
    )
    trainer.fit(module, train_dataloaders=data, val_dataloaders=data)
    return trainer


def test_callbacks_early_stopping_keeps_the_default_callbacks() -> None:
    cfg, stop = _stopping(["callbacks=early_stopping"])
    assert isinstance(stop, L.pytorch.callbacks.EarlyStopping)
    assert (stop.monitor, stop.patience, stop.mode) == ("val/loss", 3, "min")
    assert {"model_checkpoint", "export", "val_step"} <= set(cfg.callbacks)


def test_added_to_another_group_with_the_plus_form() -> None:
    cfg, stop = _stopping(
        [
            "callbacks=eval",
            "+callbacks/early_stopping=val_loss",
            "callbacks.early_stopping.monitor=eval/arithmetic/exact_match",
            "callbacks.early_stopping.mode=max",
            "debug=fast",
        ]
    )
    assert {"eval", "model_checkpoint"} <= set(cfg.callbacks)
    assert cfg.callbacks.model_checkpoint.every_n_train_steps == 2  # debug=fast still applies
    assert (stop.monitor, stop.mode) == ("eval/arithmetic/exact_match", "max")


@pytest.mark.parametrize(
    ("mode", "metrics", "stop_after"),
    [
        # best at the 2nd validation, 3 without improvement: stops after the 5th
        ("min", [5.0, 4.0, 4.5, 4.2, 4.1, 1.0, 0.5], 5),
        # improves by less than min_delta=0.1 counts as no improvement
        ("max", [0.1, 0.5, 0.55, 0.58, 0.59, 0.9], 5),
        # keeps improving: runs to max_steps
        ("min", [float(10 - i) for i in range(20)], 20),
    ],
)
def test_stops_at_the_step_the_metric_sequence_implies(mode, metrics, stop_after) -> None:
    _, stop = _stopping(
        [
            "callbacks=early_stopping",
            f"callbacks.early_stopping.mode={mode}",
            "callbacks.early_stopping.min_delta=0.1",
        ]
    )
    module = Scripted("val/loss", metrics)
    trainer = _fit(stop, module)
    assert module.validations == stop_after
    assert trainer.global_step == stop_after * VAL_EVERY
    assert trainer.should_stop == (stop_after < 20)


def test_a_metric_that_is_never_logged_is_an_error() -> None:
    _, stop = _stopping(["callbacks=early_stopping", "callbacks.early_stopping.monitor=val/nope"])
    with pytest.raises(RuntimeError, match="val/nope"):
        _fit(stop, Scripted("val/loss", [1.0] * 20))
