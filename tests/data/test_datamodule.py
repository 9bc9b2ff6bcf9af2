"""AstraiDataModule: the data position survives state_dict round trips and Lightning checkpoints."""

from __future__ import annotations

from pathlib import Path

import lightning as L
import numpy as np
import pytest
import torch
from hydra.utils import instantiate
from lightning.pytorch.callbacks import ModelCheckpoint
from omegaconf import OmegaConf
from torch.utils.data import Dataset

from astrai.data.datamodule import AstraiDataModule
from astrai.data.datasets import PretrainDataset
from astrai.data.storage import H5Writer


class Indexed(Dataset):
    """Sample i is {"idx": i}: batches show exactly which samples were delivered."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"idx": torch.tensor(i), "x": torch.full((2,), float(i))}


def _ids(batch: dict[str, torch.Tensor]) -> list[int]:
    return batch["idx"].tolist()


@pytest.mark.parametrize("num_workers", [0, pytest.param(2, marks=pytest.mark.slow)])
def test_state_round_trip_continues_with_the_next_batches(num_workers: int) -> None:
    def make() -> AstraiDataModule:
        return AstraiDataModule(Indexed(30), batch_size=4, num_workers=num_workers, seed=11)

    reference = [_ids(b) for b in make().train_dataloader()]
    dm = make()
    it = iter(dm.train_dataloader())
    head = [_ids(next(it)) for _ in range(3)]  # workers have prefetched further than this
    state = dm.state_dict()
    assert state["consumed"] == 12 and state["epoch"] == 0
    resumed = make()
    resumed.load_state_dict(state)
    tail = [_ids(b) for b in resumed.train_dataloader()]
    assert head + tail == reference
    del it


def test_two_ranks_saved_one_rank_resumed() -> None:
    """The datamodule under a 2-rank trainer, resumed under 1 rank: every sample once."""

    class FakeTrainer:
        training = True

        def __init__(self, rank: int, world: int) -> None:
            self.global_rank, self.world_size = rank, world

    ranks = []
    for r in range(2):
        dm = AstraiDataModule(Indexed(40), batch_size=3, seed=2)
        dm.trainer = FakeTrainer(r, 2)
        ranks.append((dm, iter(dm.train_dataloader())))
    seen = []
    for _ in range(4):  # lockstep: each rank receives a batch, as in DDP
        for dm, it in ranks:
            batch = next(it)
            dm.on_before_batch_transfer(batch, 0)
            seen += _ids(batch)
    states = [dm.state_dict() for dm, _ in ranks]
    assert states[0] == states[1] and states[0]["consumed"] == 24
    single = AstraiDataModule(Indexed(40), batch_size=3, seed=2)
    single.load_state_dict(states[0])
    seen += [i for b in single.train_dataloader() for i in _ids(b)]
    assert sorted(seen) == list(range(40))


def test_datamodule_from_hydra_config(tmp_path: Path) -> None:
    path = tmp_path / "c.h5"
    with H5Writer(path, dtypes={"input_ids": np.uint16}) as w:
        w.add(input_ids=np.arange(200) % 300)
    cfg = OmegaConf.create(
        {
            "_target_": "astrai.data.AstraiDataModule",
            "train": {
                "_target_": "astrai.data.PretrainDataset",
                "source": str(path),
                "window_size": 16,
            },
            "val": None,
            "batch_size": 2,
            "seed": 0,
        }
    )
    dm = instantiate(cfg, _recursive_=False)
    batch = next(iter(dm.train_dataloader()))
    assert isinstance(dm.datasets["train"], PretrainDataset)
    assert batch["input_ids"].shape == (2, 16) and "attention_mask" in batch
    assert dm.val_dataloader() == []  # Lightning skips validation


class Recorder(L.LightningModule):
    """Records the sample ids each training step receives."""

    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(2))
        self.seen: list[list[int]] = []

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        self.seen.append(_ids(batch))
        return (self.w * batch["x"]).sum()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)


def _trainer(root: Path, max_steps: int, callbacks: list | None = None) -> L.Trainer:
    return L.Trainer(
        default_root_dir=root,
        max_steps=max_steps,
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=bool(callbacks),
        callbacks=callbacks or [],
        num_sanity_val_steps=0,
    )


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:You passed in a `val_dataloader` but have no `validation_step`")
@pytest.mark.filterwarnings("ignore:The dirpath has changed")
@pytest.mark.parametrize("num_workers", [0, 1])
def test_lightning_checkpoint_restores_the_data_position(tmp_path: Path, num_workers: int) -> None:
    """Fit 4 steps, checkpoint, resume to 10 steps (across an epoch end): the resumed run
    receives exactly the batches an uninterrupted run receives after step 4."""

    def data() -> AstraiDataModule:
        return AstraiDataModule(Indexed(26), batch_size=4, seed=3, num_workers=num_workers)

    full = Recorder()
    _trainer(tmp_path / "full", 10).fit(full, datamodule=data())
    assert len(full.seen) == 10

    first = Recorder()
    ckpt = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=4, save_top_k=-1)
    _trainer(tmp_path / "a", 4, [ckpt]).fit(first, datamodule=data())
    assert first.seen == full.seen[:4]
    path = tmp_path / "ckpt" / "epoch=0-step=4.ckpt"
    saved = torch.load(path, weights_only=False)["AstraiDataModule"]
    assert saved["consumed"] == 16 and saved["epoch"] == 0

    second = Recorder()
    again = ModelCheckpoint(dirpath=tmp_path / "ckpt2", every_n_train_steps=4, save_top_k=-1)
    _trainer(tmp_path / "b", 10, [again]).fit(second, datamodule=data(), ckpt_path=path)
    assert second.seen == full.seen[4:]
