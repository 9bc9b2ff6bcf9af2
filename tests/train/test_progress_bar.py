"""The training bar counts optimizer steps for a `max_steps` run (`step 6/6`), from the
resumed step after a resume, and epochs otherwise (Lightning's own bar)."""

from __future__ import annotations

from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader, IterableDataset

from astrai.train.progress import StepProgressBar


class Stream(IterableDataset):
    """An endless stream (Lightning's bar shows `?` for its length)."""

    def __iter__(self):
        g = torch.Generator().manual_seed(0)
        while True:
            yield torch.randn(4, generator=g)


class Tiny(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(4, 1)

    def training_step(self, batch: torch.Tensor, idx: int) -> torch.Tensor:
        loss = self.layer(batch).pow(2).mean()
        self.log("loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)


class Recorder(StepProgressBar):
    """Keeps what the bar showed after each batch and at the end."""

    def __init__(self) -> None:
        super().__init__(refresh_rate=1)
        self.shown: list[str] = []

    def on_train_batch_end(self, trainer, *args) -> None:
        super().on_train_batch_end(trainer, *args)
        self.shown.append(str(self.train_progress_bar))


def _fit(tmp: Path, steps: int, ckpt: str | None = None, accumulate: int = 1) -> Recorder:
    bar = Recorder()
    trainer = L.Trainer(
        accelerator="cpu",
        max_steps=steps,
        accumulate_grad_batches=accumulate,
        callbacks=[bar],
        logger=False,
        enable_model_summary=False,
        default_root_dir=tmp,
    )
    trainer.fit(Tiny(), DataLoader(Stream(), batch_size=2), ckpt_path=ckpt)
    trainer.save_checkpoint(tmp / f"step{steps}.ckpt")
    return bar


def test_a_max_steps_run_counts_steps(tmp_path: Path) -> None:
    bar = _fit(tmp_path, 6)
    assert bar.shown[0].startswith("step 1/6") and bar.shown[-1].startswith("step 6/6")
    assert all("Epoch" not in s and "?" not in s.split("[")[0] for s in bar.shown)


def test_accumulation_counts_optimizer_steps(tmp_path: Path) -> None:
    bar = _fit(tmp_path, 3, accumulate=2)
    assert bar.shown[-1].startswith("step 3/3")
    assert {s.split(" ", 2)[1] for s in bar.shown} == {"0/3", "1/3", "2/3", "3/3"}


def test_a_resumed_run_goes_on_from_its_step(tmp_path: Path) -> None:
    _fit(tmp_path, 4)
    bar = _fit(tmp_path, 8, ckpt=str(tmp_path / "step4.ckpt"))
    assert bar.shown[0].startswith("step 5/8") and bar.shown[-1].startswith("step 8/8")


def test_a_mid_epoch_resume_counts_steps(tmp_path: Path) -> None:
    """Resumed from a checkpoint written inside an epoch (Lightning then skips
    `on_train_epoch_start`), the bar still counts steps, not `Training: 4/?`."""

    def fit(steps: int, ckpt: str | None = None) -> Recorder:
        bar = Recorder()
        every3 = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=3, filename="{step}")
        trainer = L.Trainer(
            accelerator="cpu",
            max_steps=steps,
            callbacks=[bar, every3],
            logger=False,
            enable_model_summary=False,
            default_root_dir=tmp_path,
        )
        trainer.fit(Tiny(), DataLoader(torch.randn(20, 4), batch_size=2), ckpt_path=ckpt)
        return bar

    fit(4)  # 10 batches per epoch: the step-3 checkpoint is mid-epoch
    bar = fit(8, ckpt=str(tmp_path / "step=3.ckpt"))
    assert [s.split(" ", 2)[:2] for s in bar.shown] == [["step", f"{n}/8"] for n in range(4, 9)]


def test_an_epoch_run_keeps_lightnings_bar(tmp_path: Path) -> None:
    bar = Recorder()
    trainer = L.Trainer(
        accelerator="cpu",
        max_epochs=2,
        callbacks=[bar],
        logger=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        default_root_dir=tmp_path,
    )
    data = DataLoader(torch.randn(8, 4), batch_size=2)
    trainer.fit(Tiny(), data)
    assert bar.shown[0].startswith("Epoch 0:") and bar.shown[-1].startswith("Epoch 1:")
    assert "4/4" in bar.shown[-1]


def test_a_mixture_shows_each_sources_sample_count(tmp_path: Path) -> None:
    """With `data.train.sources`, the bar's figures count the samples each source gave."""
    from astrai.data.datamodule import AstraiDataModule
    from astrai.data.mixture import MixtureDataset

    vectors = [torch.randn(n, 4, generator=torch.Generator().manual_seed(n)) for n in (10, 6)]
    mix = MixtureDataset(vectors, [0.7, 0.3], ["x", "y"], num_samples=12)
    dm = AstraiDataModule(mix, batch_size=2, drop_last=True)
    bar = Recorder()
    trainer = L.Trainer(
        accelerator="cpu",
        max_steps=5,
        callbacks=[bar],
        logger=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,
    )
    trainer.fit(Tiny(), datamodule=dm)
    counts = dm.source_counts()
    assert sum(counts.values()) == 10 and set(counts) == {"x", "y"}
    assert f"samples/x={counts['x']}, samples/y={counts['y']}" in bar.shown[-1]
