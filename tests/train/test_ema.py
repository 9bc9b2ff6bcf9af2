"""`astrai.train.ema.EMA` against an EMA computed here in plain torch, through Lightning's
loop: which steps update it, resume, validation on the average, refusals. Its export is
checked in the loggers' end-to-end run (test_loggers.py)."""

from __future__ import annotations

from pathlib import Path

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from astrai.train.ema import EMA

STEPS = 7


class Linear(L.LightningModule):
    """Least squares on fixed data, plain SGD: the weights change at every step."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layer = torch.nn.Linear(4, 3)
        self.frozen = torch.nn.Linear(3, 3).requires_grad_(False)  # not averaged
        self.val_weights: list[tuple[int, torch.Tensor]] = []

    def _loss(self, batch: list[torch.Tensor]) -> torch.Tensor:
        x, y = batch
        return torch.nn.functional.mse_loss(self.frozen(self.layer(x)), y)

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        return self._loss(batch)

    def validation_step(self, batch: list[torch.Tensor], batch_idx: int) -> None:
        self.val_weights.append((self.global_step, self.layer.weight.detach().clone()))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.2)


def _data() -> DataLoader:
    """The same batch 16 times: a resumed run, which restarts Lightning's epoch, sees the
    batches the uninterrupted one saw."""
    g = torch.Generator().manual_seed(1)
    x, y = (
        torch.randn(4, 4, generator=g).repeat(16, 1),
        torch.randn(4, 3, generator=g).repeat(16, 1),
    )
    return DataLoader(TensorDataset(x, y), batch_size=4)


class Weights(L.Callback):
    """The trainable weights after each optimizer step, by global step."""

    def __init__(self) -> None:
        self.after: dict[int, dict[str, torch.Tensor]] = {}

    def on_train_batch_end(self, trainer, pl_module, *args) -> None:
        self.after[trainer.global_step] = {
            n: p.detach().clone() for n, p in pl_module.named_parameters() if p.requires_grad
        }


def _fit(tmp_path: Path, ema: EMA, *, max_steps: int = STEPS, **kw) -> tuple[Linear, Weights]:
    module, weights = Linear(), Weights()
    trainer = L.Trainer(
        accelerator="cpu",
        max_steps=max_steps,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,
        callbacks=[weights, ema, *kw.pop("callbacks", [])],
        **{"enable_checkpointing": False, "limit_val_batches": 0, **kw},
    )
    trainer.fit(module, train_dataloaders=_data(), val_dataloaders=_data())
    return module, weights


def plain_ema(after: dict[int, dict[str, torch.Tensor]], steps: list[int], decay: float):
    """decay * ema + (1 - decay) * w over the weights after `steps` (1-based), the first
    copied."""
    ema = {n: t.clone() for n, t in after[steps[0]].items()}
    for step in steps[1:]:
        ema = {n: decay * ema[n] + (1 - decay) * after[step][n] for n in ema}
    return ema


@pytest.mark.parametrize(
    ("every", "start", "updated"),
    [(1, None, [1, 2, 3, 4, 5, 6, 7]), (2, 3, [5, 7]), (3, None, [1, 4, 7]), (2, 1, [3, 5, 7])],
)
def test_the_average_is_a_plain_torch_ema_of_the_updated_steps(tmp_path, every, start, updated):
    ema = EMA(decay=0.8, update_every_n_steps=every, update_starting_at_step=start)
    module, weights = _fit(tmp_path, ema)
    expected = plain_ema(weights.after, updated, 0.8)
    assert ema.n_averaged == len(updated) and ema.latest_update_step == updated[-1]
    assert set(ema.average) == {"layer.weight", "layer.bias"}  # trainable only
    for name, value in expected.items():
        torch.testing.assert_close(ema.average[name], value, rtol=0, atol=1e-6)
    # the trained weights are the last step's, not the average
    assert torch.equal(module.layer.weight, weights.after[STEPS]["layer.weight"])
    assert not torch.allclose(ema.average["layer.weight"], module.layer.weight)


def test_gradient_accumulation_updates_once_per_optimizer_step(tmp_path) -> None:
    ema = EMA(decay=0.5)
    _, weights = _fit(tmp_path, ema, max_steps=4, accumulate_grad_batches=2)
    assert ema.n_averaged == 4
    expected = plain_ema(weights.after, [1, 2, 3, 4], 0.5)
    torch.testing.assert_close(ema.average["layer.bias"], expected["layer.bias"], rtol=0, atol=1e-6)


def test_a_resumed_run_continues_the_average_exactly(tmp_path) -> None:
    whole = EMA(decay=0.7, update_every_n_steps=2)
    _fit(tmp_path / "whole", whole)

    saver = L.pytorch.callbacks.ModelCheckpoint(
        dirpath=tmp_path / "ckpt", every_n_train_steps=4, save_top_k=-1
    )
    first = EMA(decay=0.7, update_every_n_steps=2)
    _fit(tmp_path / "first", first, max_steps=4, callbacks=[saver], enable_checkpointing=True)
    (ckpt,) = (tmp_path / "ckpt").glob("*.ckpt")
    resumed = EMA(decay=0.7, update_every_n_steps=2)
    module, weights = Linear(), Weights()
    trainer = L.Trainer(
        accelerator="cpu",
        max_steps=STEPS,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[weights, resumed],
        limit_val_batches=0,
    )
    trainer.fit(module, train_dataloaders=_data(), ckpt_path=ckpt)
    assert resumed.n_averaged == whole.n_averaged == 4
    for name, value in whole.average.items():
        assert torch.equal(resumed.average[name], value), name


def test_validation_runs_on_the_average_and_training_goes_on_with_the_weights(tmp_path):
    ema = EMA(decay=0.6, validate=True)
    module, weights = _fit(
        tmp_path, ema, limit_val_batches=1, val_check_interval=3, num_sanity_val_steps=1
    )
    seen = dict(module.val_weights)
    # the sanity check (step 0) has no average yet: it sees the initial weights
    torch.testing.assert_close(seen[0], Linear().layer.weight.detach(), rtol=0, atol=0)
    expected = plain_ema(weights.after, [1, 2, 3], 0.6)["layer.weight"]
    torch.testing.assert_close(seen[3], expected, rtol=0, atol=1e-6)
    # after validation the trained weights came back: step 4 trained from step 3's weights
    assert not torch.allclose(weights.after[3]["layer.weight"], expected)
    assert torch.equal(module.layer.weight, weights.after[STEPS]["layer.weight"])
    mid = plain_ema(weights.after, [1, 2, 3, 4, 5, 6, 7], 0.6)
    torch.testing.assert_close(ema.average["layer.weight"], mid["layer.weight"], atol=1e-6, rtol=0)


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"decay": 1.5}, r"callbacks\.ema\.decay: 1\.5"),
        ({"update_every_n_steps": 0}, r"callbacks\.ema\.update_every_n_steps: 0"),
        ({"update_starting_at_step": -1}, r"callbacks\.ema\.update_starting_at_step: -1"),
    ],
)
def test_bad_settings_are_refused_naming_the_option(kw, match) -> None:
    with pytest.raises(ValueError, match=match):
        EMA(**kw)


def test_a_checkpoint_of_other_parameters_is_refused(tmp_path) -> None:
    ema = EMA()
    ema.load_state_dict(
        {"decay": 0.999, "n_averaged": 1, "latest_update_step": 1, "average": {"x": torch.ones(1)}}
    )
    with pytest.raises(ValueError, match=r"callbacks\.ema: the checkpoint's average"):
        _fit(tmp_path, ema, max_steps=1)


def test_disabled_keeps_nothing(tmp_path) -> None:
    ema = EMA(enabled=False)
    _fit(tmp_path, ema, max_steps=2)
    assert ema.n_averaged == 0 and ema.average == {}


def test_sharded_weights_are_refused() -> None:
    from types import SimpleNamespace

    from lightning.pytorch.strategies import FSDPStrategy

    trainer = SimpleNamespace(strategy=FSDPStrategy())
    with pytest.raises(ValueError, match=r"callbacks\.ema: sharded weights"):
        EMA().on_train_start(trainer, Linear())
