"""AstraiDataModule: connect + prepare_data fill the prepared-data cache once for every rank,
and the data position survives state_dict round trips and Lightning checkpoints."""

from __future__ import annotations

import copy
import logging
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import lightning as L
import numpy as np
import pytest
import torch
from data_helpers import write_lines
from hydra.utils import instantiate
from lightning.pytorch.callbacks import ModelCheckpoint
from omegaconf import OmegaConf
from torch.utils.data import Dataset

from astrai.data.datamodule import AstraiDataModule
from astrai.data.datasets import PreferenceDataset, PretrainDataset, PromptDataset, SFTDataset
from astrai.data.fingerprint import DataChangedError
from astrai.data.storage import H5Writer
from astrai.tokenizer import AutoTokenizer


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
        lightning_module = None  # no module: the data module's defaults (no batch reuse)

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


# ------------------------------------------------------------------ connect + prepare_data


class _Rank:
    """What the datamodule reads of a Trainer: its rank (Lightning calls prepare_data on local
    rank 0 only, then setup on every rank)."""

    training = False

    def __init__(self, rank: int, world: int = 2) -> None:
        self.global_rank, self.world_size = rank, world


def _sft_spec(n: int = 20, **prepare: object) -> dict:
    return {
        "_target_": "astrai.data.SFTDataset",
        "source": "builtin:arithmetic/sft/train",
        "prepare": {"builtin": {"n": n, "seed": 0}, **prepare},
    }


def test_connect_gives_every_rank_the_path_rank_zero_prepares(tmp_path: Path, tok_dir) -> None:
    spec = _sft_spec()
    given = copy.deepcopy(spec)
    ranks = [AstraiDataModule(train=spec, batch_size=2) for _ in range(2)]
    for r, dm in enumerate(ranks):
        dm.connect(tok_dir, tmp_path)
        dm.trainer = _Rank(r)
    assert spec == given  # the caller's config is not edited; each datamodule owns a copy
    path = Path(ranks[0].specs["train"]["source"])
    assert str(path) == ranks[1].specs["train"]["source"]  # a hash: no talking needed
    assert path.parent.parent == tmp_path / "prepared" and path.parent.name.startswith("sft-")
    assert path.name == "train.h5" and not path.exists()  # connect only plans
    fingerprint = AutoTokenizer.from_pretrained(tok_dir).fingerprint
    assert ranks[1].specs["train"]["tokenizer_fingerprint"] == fingerprint
    assert "prepare" not in ranks[1].specs["train"]
    # under a trainer, setup never prepares (rank 0's prepare_data hook does)
    with pytest.raises(Exception, match="storage file not found"):
        ranks[1].setup("fit")
    ranks[0].prepare_data()  # Lightning: local rank 0, while the others wait
    assert path.is_file()
    for dm in ranks:
        dm.setup("fit")
        assert isinstance(dm.datasets["train"], SFTDataset) and len(dm.datasets["train"]) == 20


def test_without_a_trainer_setup_prepares_and_a_changed_file_gets_a_new_cache(
    tmp_path: Path, tok_dir
) -> None:
    corpus = tmp_path / "corpus.jsonl"
    write_lines(corpus, [{"text": "def f(x):\n    return x + 1\n" * 20}] * 4)
    spec = {
        "_target_": "astrai.data.PretrainDataset",
        "source": str(corpus),
        "window_size": 8,
        "prepare": {},
    }
    dm = AstraiDataModule(train=spec, batch_size=2)
    dm.connect(tok_dir, tmp_path / "cache")
    batch = next(iter(dm.train_dataloader()))
    assert batch["input_ids"].shape == (2, 8)
    first = dm.specs["train"]["source"]
    assert Path(first).parent.name.startswith("pretrain-")  # PretrainDataset.kind
    write_lines(corpus, [{"text": "other text " * 50}])
    again = AstraiDataModule(train=spec, batch_size=2)
    again.connect(tok_dir, tmp_path / "cache")
    assert again.specs["train"]["source"] != first


def test_kind_comes_from_the_dataset_class_unless_prepare_says(tmp_path: Path, tok_dir) -> None:
    assert (PretrainDataset.kind, SFTDataset.kind) == ("pretrain", "sft")
    assert (PreferenceDataset.kind, PromptDataset.kind) == ("preference", "prompt")
    spec = {**_sft_spec(), "_target_": "astrai.data.PretrainDataset", "window_size": 8}
    spec["prepare"] = {**spec["prepare"], "kind": "sft"}  # pretrain on chat-rendered tokens
    dm = AstraiDataModule(train=spec)
    dm.connect(tok_dir, tmp_path)
    assert Path(dm.specs["train"]["source"]).parent.name.startswith("sft-")
    no_kind = {"_target_": "torch.utils.data.TensorDataset", "source": "x", "prepare": {}}
    with pytest.raises(ValueError, match=r"data\.val\.prepare\.kind: required"):
        AstraiDataModule(val=no_kind).connect(tok_dir, tmp_path)


def test_a_prepare_block_without_connect_is_a_clear_error() -> None:
    dm = AstraiDataModule(train=_sft_spec())
    with pytest.raises(ValueError, match=r"data\.train: has a prepare: block; call connect"):
        dm.setup("fit")


def test_concurrent_preparations_of_the_same_data_do_the_work_once(tmp_path: Path, tok_dir) -> None:
    """Two runs (sweep jobs, nodes) preparing the same spec: the file lock serialises them
    and the second reuses the first one's output."""
    jobs = []
    for _ in range(2):
        dm = AstraiDataModule(train=_sft_spec(200))
        dm.connect(tok_dir, tmp_path)
        jobs.append(dm.prepared["train"])
    assert jobs[0] == jobs[1]
    with ThreadPoolExecutor(2) as pool:
        results = list(pool.map(lambda job: job.run(tok_dir), jobs))
    assert sorted((r.shards_written, r.shards_reused) for r in results) == [(0, 1), (1, 0)]
    assert {r.documents for r in results} == {200}


class Noisy(Dataset):
    """Sample i with "augmentation" drawn from all three global RNGs inside __getitem__."""

    def __len__(self) -> int:
        return 24

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        import random

        noise = [torch.rand(()).item(), random.random(), float(np.random.rand())]
        return {"idx": torch.tensor(i), "noise": torch.tensor(noise, dtype=torch.float64)}


def _noise(loader) -> list[list[float]]:
    return [row for batch in loader for row in batch["noise"].tolist()]


@pytest.mark.parametrize(
    "num_workers, persistent",
    [(0, False), pytest.param(2, False, marks=pytest.mark.slow), (2, True)],
)
def test_dataset_randomness_is_the_same_after_resuming_mid_epoch(
    num_workers: int, persistent: bool
) -> None:
    """Random numbers a dataset draws per sample (augmentation) do not depend on where the
    epoch started, on the number of workers, or on the state of the global RNGs; fetching
    leaves the main process's RNG (what dropout draws from) untouched. Persistent workers
    see each new epoch too."""

    def make() -> AstraiDataModule:
        return AstraiDataModule(
            Noisy(), batch_size=4, num_workers=num_workers, seed=3, persistent_workers=persistent
        )

    torch.manual_seed(0)
    reference = _noise(make().train_dataloader())
    after = torch.rand(())
    torch.manual_seed(0)
    assert torch.equal(torch.rand(()), after)  # the loader drew nothing from the global RNG
    assert len({tuple(r) for r in reference}) == len(reference)  # samples do differ
    dm = make()
    it = iter(dm.train_dataloader())
    head = [row for _ in range(2) for row in next(it)["noise"].tolist()]
    state = dm.state_dict()
    del it
    resumed = make()
    resumed.load_state_dict(state)
    torch.manual_seed(123)  # another global state: the samples' numbers stay the same
    assert head + _noise(resumed.train_dataloader()) == reference
    second_epoch = _noise(resumed.train_dataloader())
    assert sorted(second_epoch) != sorted(reference)  # a new epoch draws new numbers


# ------------------------------------------------------------------ data fingerprint

DOCS = [np.arange(i, i + 40 + 5 * i) % 300 for i in range(6)]


def _corpus(path: Path, docs: list[np.ndarray]) -> Path:
    with H5Writer(path, dtypes={"input_ids": np.uint16}) as w:
        for doc in docs:
            w.add(input_ids=doc)
    return path


def _windows(path: Path, **kwargs: object) -> AstraiDataModule:
    spec = {"_target_": "astrai.data.PretrainDataset", "source": str(path), "window_size": 8}
    return AstraiDataModule(spec, batch_size=2, seed=0, **kwargs)


def _state_after_two_batches(path: Path) -> dict:
    dm = _windows(path)
    it = iter(dm.train_dataloader())
    next(it), next(it)
    return dm.state_dict()


def test_resume_on_the_same_data_continues(tmp_path: Path) -> None:
    path = _corpus(tmp_path / "c.h5", DOCS)
    state = _state_after_two_batches(path)
    [entry] = state["fingerprint"]["train"]
    assert entry["file"] == str(path.resolve()) and entry["bytes"] == path.stat().st_size
    reference = [b["input_ids"].tolist() for b in _windows(path).train_dataloader()]
    dm = _windows(path)
    dm.load_state_dict(state)
    assert [b["input_ids"].tolist() for b in dm.train_dataloader()] == reference[2:]


def test_resume_on_a_shuffled_file_of_the_same_size_is_refused(tmp_path: Path, caplog) -> None:
    """The same documents in another order: as many windows, the same file size, different
    samples at every position; the resumed position would silently continue on them."""
    path = _corpus(tmp_path / "c.h5", DOCS)
    state = _state_after_two_batches(path)
    size, windows = path.stat().st_size, len(_windows(path).train_sampler())
    _corpus(path, DOCS[::-1])
    assert (path.stat().st_size, len(_windows(path).train_sampler())) == (size, windows)
    dm = _windows(path)
    dm.load_state_dict(state)  # checked once the datasets exist, before any batch
    with pytest.raises(DataChangedError) as err:
        dm.train_dataloader()
    message = str(err.value)
    assert f"data.train: {path.resolve()}: same size ({size} bytes), different content" in message
    assert "fresh run" in message and "data.allow_changed_data=true" in message
    allowed = _windows(path, allow_changed_data=True)
    allowed.setup()
    with caplog.at_level(logging.WARNING):
        allowed.load_state_dict(state)  # checked at once: the datasets exist
    assert f"data.train: {path.resolve()}: same size" in caplog.text
    full = len(list(_windows(path).train_dataloader()))
    assert len(list(allowed.train_dataloader())) == full - 2  # resumed after 2 batches


def test_a_checkpoint_without_a_fingerprint_resumes_with_a_warning(tmp_path: Path, caplog) -> None:
    path = _corpus(tmp_path / "c.h5", DOCS)
    state = _state_after_two_batches(path)
    del state["fingerprint"]  # as written before fingerprints existed
    _corpus(path, DOCS[::-1])
    dm = _windows(path)
    with caplog.at_level(logging.WARNING):
        dm.load_state_dict(state)
        dm.load_state_dict(state)  # Lightning loads it twice: one warning
    assert caplog.text.count("has no fingerprint") == 1
    assert len(list(dm.train_dataloader())) > 0


class Steps(L.LightningModule):
    """Counts its training steps."""

    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(1))
        self.steps = 0

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        self.steps += 1
        return self.w.sum() * batch["input_ids"].float().mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)


@pytest.mark.filterwarnings("ignore:The dirpath has changed")
@pytest.mark.filterwarnings("ignore:You passed in a `val_dataloader` but have no `validation_step`")
def test_lightning_resume_on_changed_data_fails_before_the_first_step(tmp_path: Path) -> None:
    path = _corpus(tmp_path / "c.h5", DOCS)
    ckpt = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=2, save_top_k=-1)
    _trainer(tmp_path / "a", 2, [ckpt]).fit(Steps(), datamodule=_windows(path))
    saved = tmp_path / "ckpt" / "epoch=0-step=2.ckpt"
    assert torch.load(saved, weights_only=False)["AstraiDataModule"]["fingerprint"]["train"]
    _corpus(path, DOCS[::-1])
    resumed = Steps()
    again = ModelCheckpoint(dirpath=tmp_path / "ckpt2", every_n_train_steps=2)
    with pytest.raises(DataChangedError, match=r"data\.train: "):
        _trainer(tmp_path / "b", 4, [again]).fit(
            resumed, datamodule=_windows(path), ckpt_path=saved
        )
    assert resumed.steps == 0
