"""Training callbacks: model export, throughput/MFU, W&B run state, a checkpoint on
interruption, eval generation.

Checkpointing, learning-rate monitoring and progress bars are Lightning's own callbacks
(configured in `conf/callbacks/`); what is here is what Lightning does not provide.
`EvalCallback` lives in `astrai.train.evaluation` and is re-exported.
"""

from __future__ import annotations

import contextlib
import copy
import importlib
import json
import logging
import os
import shutil
import signal
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.fabric.utilities.seed import _collect_rng_states, _set_rng_states
from lightning.pytorch.callbacks import Callback, OnExceptionCheckpoint, ThroughputMonitor
from lightning.pytorch.loggers import WandbLogger
from lightning.pytorch.strategies import FSDPStrategy
from lightning.pytorch.utilities.exceptions import SIGTERMException
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch.distributed.fsdp import FullStateDictConfig, StateDictType
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

from astrai.files import naming_full_disk, publish
from astrai.model import Transformer, inject_lora, merge_lora, save_lora, save_pretrained
from astrai.model.reward import RewardModel
from astrai.train.module import LMModule
from astrai.train.sharding import full_state_dict, is_fully_sharded
from astrai.train.wandb_run import STATE_FILE

log = logging.getLogger(__name__)

#: where an export of a LoRA run keeps the unmerged adapter (PEFT layout), inside the export
ADAPTER_DIR = "adapter"
#: the step and epoch an export was written at
STATE_NAME = "training_state.json"

__all__ = [  # and EvalCallback, imported on first use
    "ExportCallback",
    "InterruptCheckpoint",
    "WandbRunState",
    "refresh_link",
    "throughput_monitor",
]


def __getattr__(name: str) -> Any:
    if name == "EvalCallback":  # lazy: keeps the inference engine out of imports
        return importlib.import_module("astrai.train.evaluation").EvalCallback
    raise AttributeError(f"module 'astrai.train.callbacks' has no attribute {name!r}")


# ---------------------------------------------------------------------- export
def refresh_link(link: str | os.PathLike, target: str | os.PathLike) -> None:
    """Point `link` at `target` atomically (a symlink; a copy where symlinks fail)."""
    link, target = Path(link), Path(target).resolve()
    link.parent.mkdir(parents=True, exist_ok=True)
    tmp = link.with_name(f".{link.name}.tmp{os.getpid()}")
    with contextlib.suppress(FileNotFoundError):
        tmp.unlink()
    try:
        tmp.symlink_to(target, target_is_directory=True)
        if link.is_dir() and not link.is_symlink():
            shutil.rmtree(link)
        os.replace(tmp, link)
    except OSError:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
        if link.is_symlink() or link.is_file():
            link.unlink()
        elif link.exists():
            shutil.rmtree(link)
        shutil.copytree(target, link)


class ExportCallback(Callback):
    """Write the trained model as a `save_pretrained` directory (the inference engine and the
    server load it), with the tokenizer; LoRA adapters are merged first, and also written
    unmerged, PEFT's layout, to `<export>/adapter` (what the server's `lora_modules` and
    PEFT's `PeftModel.from_pretrained` load on the base the run started from).

    At the end of training the export goes to `dirpath`, every path in `latest_links` (e.g.
    `outputs/<name>/latest`) is re-pointed at the run folder, so `<link>/export` is always
    the newest export, and so is every path in `generative_links` (`outputs/latest`, what
    `make serve` serves) when the export is a generative model: a reward model's export
    (`strategy=reward`, which the engine cannot serve) leaves them where they are.
    `every_n_train_steps` adds intermediate exports `dirpath/step<N>`.

    Files get the mode a plain `open()` gives (the umask's). A full disk stops the run with
    one line naming the file (`astrai.files.DiskFullError`); every file of an earlier export
    in the same place stays whole (each is written under a temporary name and renamed,
    the weights, nearly all the bytes, first).
    """

    def __init__(
        self,
        dirpath: str | os.PathLike,
        latest_links: Sequence[str | os.PathLike] = (),
        every_n_train_steps: int | None = None,
        enabled: bool = True,
        hf_format: bool = False,
        generative_links: Sequence[str | os.PathLike] = (),
    ) -> None:
        self.dirpath = Path(dirpath)
        self.latest_links = [Path(p) for p in latest_links]
        self.generative_links = [Path(p) for p in generative_links]
        self.every_n_train_steps = every_n_train_steps
        self.enabled = enabled
        self.hf_format = hf_format

    def export(self, trainer: L.Trainer, pl_module: L.LightningModule, path: Path) -> None:
        model = _full_model(trainer, pl_module)  # collective under FSDP: every rank calls
        if trainer.is_global_zero and model is not None:
            start = time.perf_counter()  # a 1B export takes a while: say where it goes first
            log.info("exporting the model to %s (step %d)", path, trainer.global_step)
            kept = f"files of an earlier export in {path} are whole"
            with naming_full_disk(path, kept):
                self._write(trainer, pl_module, model, path)
            log.info("exported in %.1f s", time.perf_counter() - start)
        trainer.strategy.barrier("astrai-export")

    def _write(
        self, trainer: L.Trainer, pl_module: L.LightningModule, model: Any, path: Path
    ) -> None:
        lora = pl_module.lora_config if isinstance(pl_module, LMModule) else None
        if model is True:
            pl_module.save_pretrained(path, hf_format=self.hf_format)
            policy = pl_module.model
        else:
            save_pretrained(
                merge_lora(copy.deepcopy(model)) if lora is not None else model,
                path,
                tokenizer=pl_module.tokenizer,
                hf_format=self.hf_format,
            )
            policy = model
        if lora is not None and _generative(pl_module):
            adapter = save_lora(policy, path / ADAPTER_DIR)
            log.info("LoRA adapter (PEFT layout) written to %s", adapter)
        state = {"global_step": trainer.global_step, "epoch": trainer.current_epoch}
        tmp = path / f".{STATE_NAME}.tmp"
        tmp.write_text(json.dumps(state))
        publish(tmp, path / STATE_NAME)

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any
    ) -> None:
        n = self.every_n_train_steps
        if self.enabled and n and trainer.global_step > 0 and trainer.global_step % n == 0:
            self.export(trainer, pl_module, self.dirpath / f"step{trainer.global_step:06d}")

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not self.enabled:
            return
        self.export(trainer, pl_module, self.dirpath)
        if not trainer.is_global_zero:
            return
        links = list(self.latest_links)
        if _generative(pl_module):
            links += self.generative_links
        elif self.generative_links:
            log.info(
                "%s is not a generative model (the engine cannot serve it): %s left as it is",
                self.dirpath,
                ", ".join(map(str, self.generative_links)),
            )
        for link in links:
            refresh_link(link, self.dirpath.parent)


def _generative(pl_module: L.LightningModule) -> bool:
    """Whether the module's export is a model the engine generates with (not a reward model)."""
    return not isinstance(pl_module, LMModule) or not isinstance(pl_module.model, RewardModel)


def _full_model(trainer: L.Trainer, pl_module: L.LightningModule) -> Any:
    """True to save `pl_module` as is; under FSDP (Lightning's `FSDPStrategy`, or torch's
    `fully_shard` through `FullyShardStrategy`) a full CPU copy gathered to rank 0, its LoRA
    adapters (if any) unmerged."""
    if isinstance(trainer.strategy, FSDPStrategy):
        cfg = FullStateDictConfig(offload_to_cpu=True, rank0_only=True)
        with FSDP.state_dict_type(trainer.strategy.model, StateDictType.FULL_STATE_DICT, cfg):
            state = trainer.strategy.model.state_dict()
    elif isinstance(policy := getattr(pl_module, "model", None), torch.nn.Module) and (
        is_fully_sharded(policy)
    ):
        state = full_state_dict(policy)  # collective; empty off rank 0
    else:
        return True
    if not trainer.is_global_zero:
        return None
    prefix = "_forward_module.model."
    state = {k.split(prefix, 1)[-1].removeprefix("model."): v for k, v in state.items()}
    model = Transformer(pl_module.model.config)
    if isinstance(pl_module, LMModule) and pl_module.lora_config is not None:
        inject_lora(model, pl_module.lora_config)
    model.load_state_dict(state, strict=False)
    return model.to(torch.float32)


# ---------------------------------------------------------------------- throughput
def _rows(batch: Any) -> int:
    for key in ("input_ids", "chosen_input_ids"):
        if isinstance(batch, dict) and key in batch and hasattr(batch[key], "shape"):
            return int(batch[key].shape[0])
    return 1


def _tokens(batch: Any) -> int:
    """Real (non-padding) tokens in a batch: what tokens/s counts."""
    if not isinstance(batch, dict):
        return 1
    for prefix in ("", "chosen_"):
        mask = batch.get(f"{prefix}attention_mask")
        ids = batch.get(f"{prefix}input_ids")
        if ids is None or not hasattr(ids, "shape"):
            continue
        n = int(mask.sum()) if mask is not None else int(ids.numel())
        if prefix == "chosen_" and batch.get("rejected_attention_mask") is not None:
            n += int(batch["rejected_attention_mask"].sum())
        return max(n, _rows(batch))
    return 1


def throughput_monitor(window_size: int = 20, **kwargs: Any) -> ThroughputMonitor:
    """Lightning's `ThroughputMonitor` counting tokens (`train/device/items_per_sec` = tokens/s
    per device, `train/items_per_sec` over all devices); MFU (`.../mfu`) is logged where the
    device's peak FLOPs are known, from the module's `flops_per_batch` (6 * params * tokens)."""
    return ThroughputMonitor(
        batch_size_fn=_rows, length_fn=_tokens, window_size=window_size, **kwargs
    )


# ---------------------------------------------------------------------- W&B run state
class WandbRunState(Callback):
    """Stores the W&B run id and step in every checkpoint (and next to it), so that
    `ckpt_path=...` continues the same W&B run from the checkpoint's step."""

    def __init__(self, dirpath: str | os.PathLike | None = None) -> None:
        self.dirpath = Path(dirpath) if dirpath is not None else None
        self.run_id: str | None = None
        self.step: int | None = None

    def _collect(self, trainer: L.Trainer) -> None:
        for lg in trainer.loggers:
            if isinstance(lg, WandbLogger):
                run = lg.experiment
                self.run_id = getattr(run, "id", None) or self.run_id
                with contextlib.suppress(Exception):
                    self.step = int(run.step)

    def state_dict(self) -> dict[str, Any]:
        return {"id": self.run_id, "step": self.step}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.run_id, self.step = state_dict.get("id"), state_dict.get("step")

    def on_save_checkpoint(self, trainer: L.Trainer, *args: Any) -> None:
        if not trainer.is_global_zero:
            return
        self._collect(trainer)
        if self.dirpath is not None and self.run_id:
            self.dirpath.mkdir(parents=True, exist_ok=True)
            (self.dirpath / STATE_FILE).write_text(json.dumps(self.state_dict()))


# ---------------------------------------------------------------------- interruption
#: the logger of Lightning's signal handlers (its "Received SIGTERM: 15" line)
SIGNAL_LOGGER = "lightning.pytorch.trainer.connectors.signal_connector"


class InterruptCheckpoint(OnExceptionCheckpoint):
    """Write a checkpoint when SIGTERM or SIGINT stops training, at a step boundary, so that
    `ckpt_path=last` resumes where the run stopped rather than at the last periodic checkpoint.

    SIGTERM (a scheduler's preemption, `kill`) goes through Lightning's own handling: the
    trainer notes the signal and raises `SIGTERMException` once the running optimizer step
    is over, or between two validation batches (Lightning finishes that validation on
    resume); `OnExceptionCheckpoint.on_exception` then writes the checkpoint, a consistent
    state of model, optimizer, loops, data position and random state. The first SIGINT (Ctrl+C) is
    turned into the same stop; a second one interrupts at once, through Lightning's
    `KeyboardInterrupt` handling, and writes nothing (the state may be half-way through a
    step). Any other exception writes nothing either, for the same reason. A stop during
    validation saves the random state validation started with: the one the next training
    step sees. The file goes away when a run ends normally (`OnExceptionCheckpoint.teardown`),
    so it never stands for more than a stop.

    The checkpoint holds the state after step `trainer.global_step`; the wait is one step
    (or one validation batch) and the write, so keep those within the scheduler's grace
    period.
    List this callback after `ModelCheckpoint`: Lightning's `trainer.checkpoint_callback` is
    the first `Checkpoint` callback.

    Attributes:
        signal: the signal that stopped the run (`None` while it runs).
        saved: the checkpoint written, if any.
    """

    def __init__(
        self, dirpath: str | os.PathLike, filename: str = "interrupted", sigint: bool = True
    ) -> None:
        super().__init__(dirpath, filename)
        self.sigint = sigint
        self.signal: signal.Signals | None = None
        self.saved: str | None = None
        self._rng_at_validation_start: dict[str, Any] | None = None

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # after the trainer registered its signal handlers; its teardown restores this one
        if self.sigint and threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGINT, self._on_sigint)
            logging.getLogger(SIGNAL_LOGGER).addFilter(self._name_the_signal)

    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        logging.getLogger(SIGNAL_LOGGER).removeFilter(self._name_the_signal)
        super().teardown(trainer, pl_module, stage)

    def _name_the_signal(self, record: logging.LogRecord) -> bool:
        # Ctrl+C is handed to Lightning as SIGTERM (its graceful stop), which logs "Received
        # SIGTERM: 15"; the SIGINT line above already said what happened
        return not (self.signal is signal.SIGINT and "Received SIGTERM" in record.getMessage())

    def _on_sigint(self, signum: int, frame: Any) -> None:
        if self.signal is not None:  # a second Ctrl+C: stop now (no checkpoint)
            raise KeyboardInterrupt
        self.signal = signal.SIGINT
        log.warning(
            "SIGINT: stopping after this step with a checkpoint (Ctrl+C again stops at once, "
            "without one)"
        )
        os.kill(os.getpid(), signal.SIGTERM)  # the trainer's own graceful stop

    def on_validation_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._rng_at_validation_start = _collect_rng_states(include_cuda=torch.cuda.is_available())

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._rng_at_validation_start = None

    def on_exception(
        self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException
    ) -> None:
        if not isinstance(exception, SIGTERMException) or trainer.sanity_checking:
            if isinstance(exception, KeyboardInterrupt):
                rank_zero_warn(
                    "interrupted in the middle of a step: no checkpoint written; "
                    "ckpt_path=last resumes from the last periodic checkpoint"
                )
            return
        self.signal = self.signal or signal.SIGTERM
        if self._rng_at_validation_start is not None:  # stopped during validation
            _set_rng_states(self._rng_at_validation_start)
        trainer.save_checkpoint(self.ckpt_path)
        self.saved = self.ckpt_path
        if trainer.is_global_zero:
            log.warning(
                "%s: training stopped after step %d; checkpoint written to %s. Resume with the "
                "same command and ckpt_path=last (or ckpt_path=%s).",
                signal.Signals(self.signal).name,
                trainer.global_step,
                self.ckpt_path,
                self.ckpt_path,
            )
