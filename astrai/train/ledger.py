"""The step ledger: what every optimizer step consumed and produced, next to the checkpoints.

With ``ledger=true`` a run writes ``<run dir>/ledger.h5`` (`astrai.train.ledger_store`): per
optimizer step the sample ids it trained on (positions in the epoch's order of the resumable
sampler) and each one's source (its ``data.train.sources`` entry; the names in the
``data_sources`` attribute), a digest of the collated batch, each micro-batch's loss, the gradient norm before
clipping, the learning rate, a digest of the weights after the step and of the random state
after it; for GRPO each generation batch's rollouts (prompt and completion token ids,
behaviour log-probs, rewards, policy version, seed). `python -m astrai.train.replay` re-runs any
step from the checkpoint before it and checks all of these (docs/exact-science.md).

Digests are BLAKE2b-128 over the raw bytes, so equal digests mean bit-equal tensors. The
weights digest reads every parameter once per step (BLAKE2b hashes about 0.6 GB/s on one
core: some 7 s per step for 1B fp32 parameters); ``digest_every_n_steps`` thins it.
"""

from __future__ import annotations

import hashlib
import logging
import random
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import lightning as L
import numpy as np
import torch
from lightning.pytorch.callbacks import Callback
from torch import Tensor
from torch.distributed.tensor import DTensor

from astrai.data.datamodule import AstraiDataModule
from astrai.data.mixture import MixtureDataset
from astrai.train.ledger_store import LEDGER_VERSION, LedgerFile
from astrai.train.module import grad_stats
from astrai.train.strategies.grpo.source import RecordingSource, RolloutModule

log = logging.getLogger(__name__)

__all__ = [
    "StepLedger",
    "batch_digest",
    "rng_digest",
    "sample_positions",
    "sample_sources",
    "weights_digest",
]


def _hasher() -> Any:
    return hashlib.blake2b(digest_size=16)


def _tensor_bytes(t: Tensor) -> bytes:
    if isinstance(t, DTensor):  # FSDP2's shards: the whole tensor (a collective on every rank)
        t = t.full_tensor()
    t = t.detach().cpu().contiguous()
    return t.view(torch.uint8).numpy().tobytes() if t.numel() else b""


def weights_digest(named: Iterable[tuple[str, Tensor]]) -> str:
    """Digest of (name, dtype, shape, bytes) of every tensor, in order: of a module's
    `state_dict()`, so equal to the digest of a checkpoint's ``state_dict``."""
    h = _hasher()
    for name, t in named:
        h.update(f"{name}:{t.dtype}:{tuple(t.shape)};".encode())
        h.update(_tensor_bytes(t))
    return h.hexdigest()


def rng_digest() -> str:
    """Digest of torch's CPU (and CUDA) generators, numpy's and python's: the state every
    random op of the next step starts from."""
    h = _hasher()
    h.update(_tensor_bytes(torch.get_rng_state()))
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        for state in torch.cuda.get_rng_state_all():
            h.update(_tensor_bytes(state))
    h.update(np.random.get_state()[1].tobytes())
    h.update(repr(random.getstate()).encode())
    return h.hexdigest()


def _feed(h: Any, key: str, value: Any) -> None:
    if isinstance(value, Tensor):
        h.update(f"{key}:{value.dtype}:{tuple(value.shape)};".encode())
        h.update(_tensor_bytes(value))
    elif isinstance(value, Mapping):
        for k in sorted(value):
            if k != "upcoming":  # drawn ahead for asynchronous rollouts; their own step has them
                _feed(h, f"{key}.{k}", value[k])
    elif isinstance(value, (list, tuple)):
        h.update(f"{key}[{len(value)}];".encode())
        for i, v in enumerate(value):
            _feed(h, f"{key}.{i}", v)
    elif isinstance(value, (str, int, float, bool)) or value is None:
        h.update(f"{key}={value!r};".encode())


def batch_digest(batches: Iterable[Any]) -> str:
    """Digest of the batches a step received (tensors by bytes, lists and records by value)."""
    h = _hasher()
    for i, batch in enumerate(batches):
        _feed(h, str(i), batch)
    return h.hexdigest()


def sample_positions(datamodule: Any) -> tuple[int, int]:
    """``(epoch, consumed)``: the training data position of a data module with a resumable
    sampler (`AstraiDataModule`), or ``(-1, -1)`` for one without."""
    if not isinstance(datamodule, AstraiDataModule):
        return -1, -1
    state = datamodule.state_dict()
    if "consumed" not in state:  # no sampler yet and nothing to resume: the very start
        return 0, 0
    return int(state["epoch"]), int(state["consumed"])


def sample_ids(datamodule: Any, epoch: int, start: int, end_epoch: int, end: int) -> list[int]:
    """The dataset indices at positions ``[start, end)`` of the epochs' orders (all ranks')."""
    sampler = datamodule.sampler if isinstance(datamodule, AstraiDataModule) else None
    if sampler is None or start < 0:
        return []
    ids: list[int] = []
    while epoch < end_epoch:
        ids += sampler.epoch_order(epoch)[start:].tolist()
        epoch, start = epoch + 1, 0
    return ids + sampler.epoch_order(epoch)[start:end].tolist()


def sample_sources(datamodule: Any, ids: list[int]) -> list[int]:
    """Each sample's source: its index in ``data.train.sources`` (0 for one source)."""
    train = datamodule.datasets.get("train") if isinstance(datamodule, AstraiDataModule) else None
    if isinstance(train, MixtureDataset):
        return train.locate(ids)[0].tolist()
    return [0] * len(ids)


def source_names(datamodule: Any) -> list[str] | None:
    """The names of ``data.train.sources`` (``None`` for one source)."""
    train = datamodule.datasets.get("train") if isinstance(datamodule, AstraiDataModule) else None
    return list(train.names) if isinstance(train, MixtureDataset) else None


class StepLedger(Callback):
    """Writes the step ledger. ``enabled=false`` (``ledger: false``) does nothing. Every rank
    computes the step's figures (under FSDP the gradient norm and the weights are
    collectives); rank 0 writes them.

    Args:
        path: the ledger file, ``<run dir>/ledger.h5``.
        enabled: the ``ledger`` switch.
        digest_every_n_steps: the weights digest every that many steps (1: every step).
    """

    def __init__(
        self, path: str | Path, enabled: bool = True, digest_every_n_steps: int = 1
    ) -> None:
        self.path = Path(path)
        self.enabled = bool(enabled)
        if int(digest_every_n_steps) < 1:
            raise ValueError(
                f"callbacks.ledger.digest_every_n_steps: must be >= 1, got {digest_every_n_steps}"
            )
        self.digest_every = int(digest_every_n_steps)
        self.file: LedgerFile | None = None
        self.recording = False
        self.micro_loss: list[float] = []
        self.batches: list[Any] = []
        self.grad_norm = float("nan")
        self.position: tuple[int, int] = (-1, -1)
        self.recorded_step = -1

    # ------------------------------------------------------------------ start
    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not self.enabled:
            return
        start = int(trainer.global_step)
        self.recording = True
        self.position = sample_positions(trainer.datamodule)
        self.recorded_step = start
        digest = weights_digest(pl_module.state_dict().items())
        if not trainer.is_global_zero:
            return
        fresh = not self.path.exists()
        self.file = LedgerFile(self.path, "a")
        if not fresh:
            self.file.truncate(start)  # steps after the checkpoint are recorded again
        datamodule = trainer.datamodule
        fingerprint = None
        if isinstance(datamodule, AstraiDataModule):
            fingerprint = datamodule.data_fingerprint()
        self.file.set_meta(
            version=LEDGER_VERSION,
            strategy=type(pl_module).__name__,
            world_size=int(trainer.world_size),
            threads=int(torch.get_num_threads()),
            accumulate_grad_batches=int(trainer.accumulate_grad_batches),
            data_fingerprint=fingerprint,
            data_sources=source_names(datamodule),
        )
        if fresh or "start_step" not in self.file.h5.attrs:
            self.file.set_meta(
                start_step=start,
                start_digest=digest,
                resumed_from=str(trainer.ckpt_path) if trainer.ckpt_path else None,
            )
        if isinstance(pl_module, RolloutModule):  # its rollouts go to the ledger too
            record = self._record_samples(pl_module)
            pl_module.wrap_source(lambda source: RecordingSource(source, record))
        log.info("step ledger: %s (from step %d)", self.path, start)

    def _record_samples(self, pl_module: L.LightningModule) -> Any:
        def record(seed: int, samples: Any) -> None:
            if self.file is None:
                return
            self.file.append_rollout(
                {
                    **samples.state_dict(),
                    "seed": int(seed),
                    "step": int(pl_module.global_step),
                    "version": int(samples.version),
                }
            )

        return record

    # ------------------------------------------------------------------ each step
    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if self.recording:
            self.batches.append(batch)

    def on_before_optimizer_step(
        self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer: Any
    ) -> None:
        if not self.recording:
            return
        grads = [p.grad for p in pl_module.parameters() if p.grad is not None]
        self.grad_norm = grad_stats(grads)["grad_norm"] if grads else 0.0

    def on_train_batch_end(
        self,
        trainer: L.Trainer,
        pl_module: L.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
    ) -> None:
        if not self.recording:
            return
        loss = outputs["loss"] if isinstance(outputs, Mapping) else outputs
        self.micro_loss.append(float(loss.detach().double()) if loss is not None else float("nan"))
        step = int(trainer.global_step)
        if step <= self.recorded_step:  # accumulating: the optimizer has not stepped yet
            return
        self.step_ended(trainer, step, self.step_record(trainer, pl_module, step))
        self.recorded_step = step
        self.micro_loss, self.batches = [], []

    def step_ended(self, trainer: L.Trainer, step: int, record: dict[str, Any]) -> None:
        """What becomes of a finished step's row: rank 0 appends it (a replay compares it)."""
        if self.file is not None:
            self.file.append_step(record)

    def step_record(
        self, trainer: L.Trainer, pl_module: L.LightningModule, step: int
    ) -> dict[str, Any]:
        """The ledger row of the optimizer step that just ended."""
        epoch, start = self.position
        self.position = end_epoch, end = sample_positions(trainer.datamodule)
        digest = ""
        if step % self.digest_every == 0:
            digest = weights_digest(pl_module.state_dict().items())
        optimizers = trainer.optimizers
        lr = float(optimizers[0].param_groups[0]["lr"]) if optimizers else float("nan")
        ids = sample_ids(trainer.datamodule, epoch, start, end_epoch, end)
        return {
            "step": step,
            "loss": float(np.mean(self.micro_loss)) if self.micro_loss else float("nan"),
            "micro_loss": list(self.micro_loss),
            "grad_norm": self.grad_norm,
            "lr": lr,
            "weights_digest": digest,
            "rng_digest": rng_digest(),
            "batch_digest": batch_digest(self.batches),
            "epoch": epoch,
            "sample_start": start,
            "sample_end": end,
            "sample_ids": ids,
            "sample_sources": sample_sources(trainer.datamodule, ids),
        }

    # ------------------------------------------------------------------ end
    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        self.recording = False
        if self.file is not None:
            self.file.close()
            self.file = None
