"""`LMModule`: the LightningModule every training strategy (pretrain, sft, dpo, grpo) extends.

It owns the policy model (built from a preset or loaded from a directory), the tokenizer,
optional LoRA adapters, the optimizer/schedule (from `astrai.train.optim`) and the
non-finite-loss guard. A strategy implements only `compute_loss(batch) -> (loss, metrics)`;
Lightning does the loop, precision, accumulation, clipping, distribution and checkpointing.
"""

from __future__ import annotations

import logging
import math
from abc import ABC, abstractmethod
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from omegaconf import DictConfig, OmegaConf
from torch import Tensor

from astrai.model import LoRAConfig, Transformer, inject_lora, merge_lora, preset
from astrai.model.hub import load_pretrained
from astrai.tokenizer import AutoTokenizer

log = logging.getLogger(__name__)

__all__ = ["LMModule", "NonFiniteLossError", "VocabMismatchError", "build_model"]


class NonFiniteLossError(RuntimeError):
    """Raised when the loss (or gradient norm) is NaN/inf, before any weight is changed."""


class VocabMismatchError(ValueError):
    """The tokenizer produces ids the model's embedding table cannot hold."""


def _plain(cfg: Any) -> Any:
    """DictConfig/ListConfig -> plain containers (hyperparameters must be picklable YAML)."""
    if isinstance(cfg, DictConfig) or OmegaConf.is_config(cfg):
        return OmegaConf.to_container(cfg, resolve=True)
    return cfg


def build_model(
    spec: Mapping[str, Any],
    *,
    tokenizer: AutoTokenizer | None = None,
    device: str | torch.device | None = None,
) -> Transformer:
    """A `Transformer` from `{"preset": name, **overrides}` or `{"path": dir}`.

    With a tokenizer, a preset without an explicit `vocab_size` keeps its own size; in
    every case the tokenizer's ids must fit the embedding table, or `VocabMismatchError`
    names both sizes (a silent mismatch would index out of range mid-run).
    `device="meta"` builds without allocating (shape checks and parameter counts).
    """
    spec = dict(_plain(spec) or {})
    path = spec.pop("path", None)
    name = spec.pop("preset", None)
    if (path is None) == (name is None):
        raise ValueError(
            f"model: give exactly one of `preset` (one of astrai.model.PRESETS) or `path` "
            f"(a model directory); got {dict(spec, preset=name, path=path)}"
        )
    if path is not None:
        if spec:
            raise ValueError(f"model: with `path`, no other fields are allowed; got {sorted(spec)}")
        if device is not None and torch.device(device).type == "meta":
            from astrai.model.hub import read_config

            config = read_config(path)
            with torch.device("meta"):
                model = Transformer(config)
        else:
            model = load_pretrained(path, dtype=torch.float32)
            model.train()
        source = f"model directory {path}"
    else:
        config = preset(name, **spec)
        if device is not None:
            with torch.device(device):
                model = Transformer(config)
        else:
            model = Transformer(config)
        source = f"model preset {name!r}"
    if tokenizer is not None:
        check_vocab(model.config.vocab_size, tokenizer, source=source)
    return model


def check_vocab(vocab_size: int, tokenizer: AutoTokenizer, *, source: str = "model") -> None:
    """Raise `VocabMismatchError` when the tokenizer has more ids than the model's vocabulary."""
    n = len(tokenizer)
    if n > vocab_size:
        raise VocabMismatchError(
            f"tokenizer has {n} tokens but {source} has vocab_size={vocab_size}; "
            f"use a model with vocab_size >= {n} (e.g. model.vocab_size={n}) "
            f"or a tokenizer trained with a smaller vocabulary"
        )


def _to_safe(states: dict[str, Any]) -> dict[str, Any]:
    """RNG states as plain lists: loadable with `weights_only=True` (Lightning's default) and
    safe for `all_gather_object` (which cannot carry tensors between gloo ranks here)."""
    out = dict(states)
    out["torch"] = states["torch"].tolist()
    if "torch.cuda" in out:
        out["torch.cuda"] = [t.tolist() for t in states["torch.cuda"]]
    if "numpy" in out:
        kind, keys, *rest = states["numpy"]
        out["numpy"] = (kind, keys.tolist(), *rest)
    return out


def _from_safe(states: dict[str, Any]) -> dict[str, Any]:
    out = dict(states)
    out["torch"] = torch.tensor(states["torch"], dtype=torch.uint8)
    if "torch.cuda" in out:
        cuda = [torch.tensor(t, dtype=torch.uint8) for t in states["torch.cuda"]]
        if len(cuda) == torch.cuda.device_count():
            out["torch.cuda"] = cuda
        else:  # resumed on another number of GPUs: leave their generators seeded
            del out["torch.cuda"]
    if "numpy" in out:
        import numpy as np

        kind, keys, *rest = states["numpy"]
        out["numpy"] = (kind, np.asarray(keys, dtype=np.uint32), *rest)
    return out


class LMModule(L.LightningModule, ABC):
    """Base LightningModule for language-model training strategies.

    Args:
        model: `{"preset": "astrai-5m", **overrides}` or `{"path": "<model dir>"}`.
        optim: optimizer + schedule config, see `astrai.train.optim.configure_optimizers`.
        tokenizer: tokenizer directory; its size is checked against the model's vocabulary,
            and it is saved with every export.
        lora: `LoRAConfig` fields; when given, only adapters train (exports merge them).
        gradient_checkpointing: recompute block activations in backward (memory for time).
        check_grad_finite: also stop on a non-finite gradient norm, before the optimizer
            step, so no checkpoint is ever written with NaN weights.
    """

    def __init__(
        self,
        model: Mapping[str, Any],
        optim: Mapping[str, Any],
        tokenizer: str | None = None,
        lora: Mapping[str, Any] | None = None,
        gradient_checkpointing: bool = False,
        check_grad_finite: bool = True,
        **kwargs: Any,
    ) -> None:
        super().__init__()
        model, optim, lora = _plain(model), _plain(optim), _plain(lora)
        tokenizer = str(tokenizer) if tokenizer is not None else None
        self.save_hyperparameters(
            {
                "model": model,
                "optim": optim,
                "tokenizer": tokenizer,
                "lora": lora,
                "gradient_checkpointing": gradient_checkpointing,
                "check_grad_finite": check_grad_finite,
                **{k: _plain(v) for k, v in kwargs.items()},
            }
        )
        self.optim_config: dict[str, Any] = dict(optim or {})
        self.check_grad_finite = check_grad_finite
        self.tokenizer: AutoTokenizer | None = (
            AutoTokenizer.from_pretrained(tokenizer) if tokenizer else None
        )
        self.model: Transformer = build_model(model, tokenizer=self.tokenizer)
        self.model.gradient_checkpointing = bool(gradient_checkpointing)
        self.lora_config: LoRAConfig | None = None
        if lora:
            self.lora_config = LoRAConfig(**lora)
            inject_lora(self.model, self.lora_config)
        self.flops_per_token: float = 6.0 * self.model.num_parameters()
        self.flops_per_batch: float | None = None  # read by Lightning's ThroughputMonitor

    # ------------------------------------------------------------------ to implement
    @abstractmethod
    def compute_loss(self, batch: dict[str, Any]) -> tuple[Tensor, dict[str, Tensor]]:
        """Return the scalar loss to minimise and extra metrics (logged as `train/<name>`)."""

    # ------------------------------------------------------------------ helpers
    def forward(self, input_ids: Tensor, **kwargs: Any) -> Tensor:
        return self.model(input_ids, **kwargs)

    @staticmethod
    def token_logprobs(
        model: torch.nn.Module,
        input_ids: Tensor,
        attention_mask: Tensor | None = None,
        position_ids: Tensor | None = None,
    ) -> Tensor:
        """`[B, S-1]` log p(x_t | x_<t) for t = 1..S-1, in fp32.

        Uses `cross_entropy(reduction="none")` rather than a full `log_softmax` + gather, so
        no second `[B, S, V]` tensor is materialised.
        """
        logits = model(input_ids, position_ids=position_ids, attention_mask=attention_mask)
        logits = logits[:, :-1].float()
        targets = input_ids[:, 1:]
        nll = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="none")
        return -nll.view_as(targets)

    def export_model(self) -> Transformer:
        """The model as it should be saved: LoRA adapters merged into a copy when present."""
        if self.lora_config is None:
            return self.model
        import copy

        return merge_lora(copy.deepcopy(self.model))

    def save_pretrained(self, path: str | Path, **kwargs: Any) -> Path:
        """`save_pretrained` the (merged) model with the tokenizer into `path`."""
        path = Path(path)
        self.export_model().save_pretrained(path, tokenizer=self.tokenizer, **kwargs)
        return path

    @staticmethod
    def _batch_size(batch: dict[str, Any]) -> int:
        for key in ("input_ids", "chosen_input_ids"):
            if key in batch and isinstance(batch[key], Tensor):
                return int(batch[key].shape[0])
        return 1

    def _check_finite(self, loss: Tensor, what: str) -> None:
        if not bool(torch.isfinite(loss.detach()).all()):
            ckpt = "none yet"
            trainer = self._trainer
            if trainer is not None and trainer.checkpoint_callback is not None:
                ckpt = getattr(trainer.checkpoint_callback, "last_model_path", "") or "none yet"
            step = trainer.global_step if trainer is not None else -1
            raise NonFiniteLossError(
                f"{what} is {loss.detach().float().item()} at global step {step}; training "
                f"stopped before the optimizer step, so the last checkpoint ({ckpt}) is "
                f"intact. Lower optim.lr, enable trainer.gradient_clip_val, or check the data."
            )

    # ------------------------------------------------------------------ Lightning hooks
    def training_step(self, batch: dict[str, Any], batch_idx: int) -> Tensor:
        if "input_ids" in batch and isinstance(batch["input_ids"], Tensor):
            ids = batch["input_ids"]
            self.flops_per_batch = self.flops_per_token * ids.numel()
        loss, metrics = self.compute_loss(batch)
        self._check_finite(loss, "the training loss")
        bs = self._batch_size(batch)
        self.log("train/loss", loss.detach(), prog_bar=True, batch_size=bs)
        for key, value in metrics.items():
            self.log(f"train/{key}", value, batch_size=bs)
        return loss

    def validation_step(self, batch: dict[str, Any], batch_idx: int) -> Tensor:
        loss, metrics = self.compute_loss(batch)
        bs = self._batch_size(batch)
        self.log("val/loss", loss, prog_bar=True, sync_dist=True, batch_size=bs)
        for key, value in metrics.items():
            self.log(f"val/{key}", value, sync_dist=True, batch_size=bs)
        return loss

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        if not self.check_grad_finite:
            return
        grads = [p.grad for p in self.model.parameters() if p.grad is not None]
        if not grads:
            return
        norm = torch.nn.utils.get_total_norm(grads, norm_type=2.0, foreach=True)
        precision = str(getattr(self.trainer, "precision", ""))
        if precision.startswith("16"):  # the fp16 GradScaler skips inf steps by design
            return
        self._check_finite(norm, "the gradient norm")
        self.log("train/grad_norm", norm, batch_size=1)

    # ------------------------------------------------------------------ exact resume
    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Add every rank's RNG states (Lightning's checkpoint has none), for exact resume of
        anything random (dropout, LoRA dropout, sampling) across an interruption."""
        from lightning.fabric.utilities.seed import _collect_rng_states

        states = _to_safe(_collect_rng_states(include_cuda=torch.cuda.is_available()))
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            gathered: list[Any] = [None] * torch.distributed.get_world_size()
            torch.distributed.all_gather_object(gathered, states)
            checkpoint["astrai_rng_states"] = gathered
        else:
            checkpoint["astrai_rng_states"] = [states]

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        self._resume_rng = checkpoint.get("astrai_rng_states")

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        # restored here, at the first step after resuming, rather than at load time: Lightning
        # builds dataloaders (which draw from the global RNG) between loading and this step
        states = getattr(self, "_resume_rng", None)
        if states:
            from lightning.fabric.utilities.seed import _set_rng_states

            rank = self.global_rank if self._trainer is not None else 0
            if rank < len(states):
                _set_rng_states(_from_safe(states[rank]))
            self._resume_rng = None

    def configure_optimizers(self) -> Any:
        from astrai.train.optim import configure_optimizers

        total = None
        if self._trainer is not None:
            est = self.trainer.estimated_stepping_batches
            total = int(est) if est is not None and math.isfinite(est) else None
        return configure_optimizers(self.model, self.optim_config, total_steps=total)
