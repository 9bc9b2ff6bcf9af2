"""An exponential moving average (EMA) of the trained weights (`callbacks.ema`).

Lightning's `EMAWeightAveraging` keeps a deep copy of the whole LightningModule (reference
models, tokenizer, rollout engine included), writes the average over the checkpoint's
`state_dict` and copies it into the model at the end of training: astrai's checkpoints,
replay digests and main export are the trained weights, so this callback keeps its own copy
of the trainable parameters only (under LoRA, the adapters: the frozen base is its own
average) in its callback state. Its options and their meaning are Lightning's
(`decay`, `update_every_n_steps`, `update_starting_at_step`, zero-based step indices), and
the update is torch's (`torch.optim.swa_utils.get_ema_multi_avg_fn`): the first update copies
the weights, each later one sets `ema = decay * ema + (1 - decay) * w`.

The average is saved in every checkpoint, so a resumed run continues it exactly; it is
exported as its own model to `<export>/ema` when `export=true` (loadable like the main
export), and `validate=true` runs validation on it (the trained weights are swapped back
before training continues). Sharded weights (FSDP, tensor parallel) are refused: each rank
would average its own shard, and nothing gathers them for the export yet.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.strategies import FSDPStrategy
from torch.distributed.tensor import DTensor
from torch.optim.swa_utils import get_ema_multi_avg_fn

from astrai.train.callbacks import ExportCallback

__all__ = ["EMA", "EMA_EXPORT_DIR"]

log = logging.getLogger(__name__)

#: the average's export, under the main export folder
EMA_EXPORT_DIR = "ema"


class EMA(Callback):
    """An EMA of the trainable weights, updated after optimizer steps (see the module's
    docstring); `device="cpu"` keeps it off the accelerator."""

    def __init__(
        self,
        decay: float = 0.999,
        update_every_n_steps: int = 1,
        update_starting_at_step: int | None = None,
        validate: bool = False,
        export: bool = False,
        device: str | None = None,
        enabled: bool = True,
    ) -> None:
        if not 0.0 <= decay <= 1.0:
            raise ValueError(f"callbacks.ema.decay: {decay} is not in [0, 1]")
        if update_every_n_steps < 1:
            raise ValueError(
                f"callbacks.ema.update_every_n_steps: {update_every_n_steps} is not a positive "
                "number of optimizer steps"
            )
        if update_starting_at_step is not None and update_starting_at_step < 0:
            raise ValueError(
                f"callbacks.ema.update_starting_at_step: {update_starting_at_step} is negative"
            )
        self.decay = decay
        self.update_every_n_steps = update_every_n_steps
        self.update_starting_at_step = update_starting_at_step
        self.validate = validate
        self.export = export
        self.device = torch.device(device) if device else None
        self.enabled = enabled
        self.n_averaged = 0
        self.latest_update_step = 0
        self.average: dict[str, torch.Tensor] = {}
        self._params: dict[str, torch.nn.Parameter] = {}
        self._loaded: dict[str, Any] | None = None
        self._swapped = False
        self._avg_fn = get_ema_multi_avg_fn(decay)

    # ------------------------------------------------------------------ when
    def should_update(self, step_idx: int) -> bool:
        """Whether the optimizer step `step_idx` (zero-based) updates the average: from
        `update_starting_at_step` on, every `update_every_n_steps` (Lightning's rule)."""
        start = self.update_starting_at_step
        return (start is None or step_idx >= start) and step_idx % self.update_every_n_steps == 0

    # ------------------------------------------------------------------ hooks
    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not self.enabled:
            return
        self._params = _trainable(trainer, pl_module)
        if self._loaded is not None:
            self._restore(self._loaded)
            self._loaded = None

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any
    ) -> None:
        step = trainer.global_step
        if self.enabled and step > self.latest_update_step and self.should_update(step - 1):
            self.update()
            self.latest_update_step = step

    def on_validation_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.enabled and self.validate and self.n_averaged and not trainer.sanity_checking:
            self._swap()

    def on_validation_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self._swapped:
            self._swap()

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not (self.enabled and self.export):
            return
        exporters = [c for c in trainer.callbacks if isinstance(c, ExportCallback) and c.enabled]
        if not exporters:
            log.warning("callbacks.ema.export=true but no export is written (export=false)")
            return
        if not self.n_averaged:
            log.warning("callbacks.ema: no optimizer step updated the average; not exported")
            return
        path = Path(exporters[0].dirpath) / EMA_EXPORT_DIR
        self._swap()
        try:
            exporters[0].export(trainer, pl_module, path)
        finally:
            self._swap()

    # ------------------------------------------------------------------ the average
    def update(self) -> None:
        """Fold the current weights into the average (the first update copies them)."""
        names = list(self._params)
        current = [self._params[n].detach().to(self._device_of(n)) for n in names]
        if not self.n_averaged:
            self.average = {n: w.clone() for n, w in zip(names, current, strict=True)}
        else:
            average = [self.average[n] for n in names]
            self._avg_fn(average, current, torch.tensor(self.n_averaged))
        self.n_averaged += 1

    def _device_of(self, name: str) -> torch.device:
        return self.device or self._params[name].device

    def _swap(self) -> None:
        """Exchange the trained weights and the average in place."""
        with torch.no_grad():
            for name, param in self._params.items():
                kept = param.detach().clone()
                param.copy_(self.average[name])
                self.average[name].copy_(kept)
        self._swapped = not self._swapped

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        if self._loaded is not None:  # restored but not yet started: keep it as it came
            return self._loaded
        return {
            "decay": self.decay,
            "n_averaged": self.n_averaged,
            "latest_update_step": self.latest_update_step,
            "average": {n: t.detach().cpu() for n, t in self.average.items()},
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._loaded = state_dict  # the parameters are known at on_train_start

    def _restore(self, state: dict[str, Any]) -> None:
        if state["decay"] != self.decay:
            log.warning(
                "callbacks.ema.decay=%s, the checkpoint's average was built with %s; "
                "continuing it with %s",
                self.decay,
                state["decay"],
                self.decay,
            )
        average = state["average"]
        if average and set(average) != set(self._params):
            missing = sorted(set(self._params) ^ set(average))[:5]
            raise ValueError(
                "callbacks.ema: the checkpoint's average is over other parameters than this "
                f"run trains (differing: {missing}); start a fresh average with "
                "callbacks.ema=null on the first resume, or resume with the same model"
            )
        self.average = {n: t.to(self._device_of(n)) for n, t in average.items()}
        self.n_averaged = int(state["n_averaged"])
        self.latest_update_step = int(state["latest_update_step"])


def _trainable(trainer: L.Trainer, pl_module: L.LightningModule) -> dict[str, torch.nn.Parameter]:
    """The parameters the optimizer trains, by name; sharded ones are refused."""
    params = {n: p for n, p in pl_module.named_parameters() if p.requires_grad}
    if isinstance(trainer.strategy, FSDPStrategy) or any(
        isinstance(p, DTensor) for p in params.values()
    ):
        raise ValueError(
            "callbacks.ema: sharded weights (FSDP / tensor parallel) are not supported; "
            "train with one process or DDP, or drop the EMA (callbacks.ema.enabled=false)"
        )
    if not params:
        raise ValueError("callbacks.ema: the module has no trainable parameters to average")
    return params
