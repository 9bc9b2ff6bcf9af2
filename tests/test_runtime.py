"""`astrai.runtime`: the torch thread count from two load readings (#54.2) and the third-party
warnings every command filters (#54.11)."""

from __future__ import annotations

import logging
import warnings

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader

import astrai.runtime as runtime
from astrai.runtime import LoadReadings, choose_threads, set_threads, setup_logging


# ------------------------------------------------------------------------- threads
@pytest.mark.parametrize(
    ("sampled", "load_average", "threads"),
    [
        (0.0, 3.8, 1),  # a lull of bursty load (#54.2: "0.0 busy" at load 3.8): 1 thread
        (1.0, 0.05, 1),  # a competitor that started a moment ago: the sample sees it
        (0.0, 0.1, 2),  # a quiet machine: both cores
        (0.2, 0.4, 2),  # background noise is not a busy process
        (None, 1.2, 1),  # no /proc/stat (not Linux): the load average alone
        (None, None, 2),  # nothing known: every core
    ],
)
def test_the_busier_reading_sets_the_threads(sampled, load_average, threads) -> None:
    assert choose_threads(2, LoadReadings(sampled, load_average).busy) == threads


def test_set_threads_applies_the_rule_to_torch(monkeypatch, caplog) -> None:
    """The readings at start go through the rule into torch, and the log line shows both."""
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(runtime, "available_cores", lambda: 2)
    monkeypatch.setattr(runtime, "read_load", lambda window=0.25: LoadReadings(0.0, 3.8))
    before = torch.get_num_threads()
    try:
        with caplog.at_level(logging.INFO, logger="astrai"):
            assert set_threads(None) == 1 and torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)
    assert "torch threads: 1 (2 cores; busy: 0.0 now, 3.8 over 1 min)" in caplog.text


def test_the_load_average_counts_only_this_processs_share_of_the_machine(monkeypatch) -> None:
    """A container pinned to 2 of 16 cores sees an eighth of the machine's load average."""
    monkeypatch.setattr(runtime.os, "getloadavg", lambda: (8.0, 8.0, 8.0))
    monkeypatch.setattr(runtime.os, "cpu_count", lambda: 16)
    monkeypatch.setattr(runtime, "available_cores", lambda: 2)
    assert runtime.load_average() == pytest.approx(1.0)


# ------------------------------------------------------------------------- warnings
class _Tiny(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(4, 1)

    def training_step(self, batch: torch.Tensor, idx: int) -> torch.Tensor:
        return self.layer(batch).pow(2).mean()

    def validation_step(self, batch: torch.Tensor, idx: int) -> None:
        self.log("val/loss", self.layer(batch).pow(2).mean())

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)


def _fit_warnings(tmp_path, monkeypatch, level: str) -> list[str]:
    """What a fit with one DataLoader worker and an empty validation loader warns, on a
    machine where Lightning would suggest more workers, after `setup_logging(level)`."""
    from lightning.pytorch.trainer.connectors import data_connector

    monkeypatch.setattr(data_connector, "suggested_max_num_workers", lambda *a: 4)
    monkeypatch.setenv("WANDB_QUIET", "true")
    root = logging.getLogger().level
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        setup_logging(level)
        trainer = L.Trainer(
            accelerator="cpu",
            max_steps=2,
            logger=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            enable_checkpointing=False,
            default_root_dir=tmp_path,
        )
        data = DataLoader(torch.randn(8, 4), batch_size=2)
        trainer.fit(_Tiny(), data, DataLoader(torch.randn(0, 4), batch_size=2))
    logging.getLogger().setLevel(root)
    return [str(w.message) for w in caught]


def test_lightning_warnings_nobody_can_act_on_are_filtered(tmp_path, monkeypatch) -> None:
    shown = _fit_warnings(tmp_path, monkeypatch, "info")
    assert not [m for m in shown if "does not have many workers" in m], shown
    assert not [m for m in shown if "across ranks is zero" in m], shown
    # log_level=debug shows them (the filters are what hides them)
    shown = _fit_warnings(tmp_path / "debug", monkeypatch, "debug")
    assert any("does not have many workers" in m for m in shown), shown
    assert any("across ranks is zero" in m for m in shown), shown


def test_tqdm_warnings_are_filtered() -> None:
    from tqdm import tqdm

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        setup_logging("info")
        with open("/dev/null", "w") as sink:
            bar = tqdm(total=2, file=sink)
            bar.n = 2.4  # a rounded count just past the total: "clamping frac to range [0, 1]"
            bar.refresh()
            bar.close()
    assert not [w for w in caught if "clamping frac" in str(w.message)]
