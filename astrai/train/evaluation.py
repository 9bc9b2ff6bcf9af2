"""Evaluation during training: the suites of `astrai.eval`, on the live weights, every N steps.

Every ``every_n_steps`` optimizer steps the callback runs each configured suite (generation
with exact match, multiple choice by log-likelihood, perplexity, code pass@k) through the
run's one :class:`~astrai.inference.InferenceEngine` on the *live* policy weights
(``LMModule.policy_engine``, shared with GRPO's rollouts and the live policy server; this
callback declares its sizes in ``setup``; ``start=False``: ``run_batch`` and ``score`` run
synchronously on the training thread; its policy version is brought up to the step before
every use, so no stale prefix-cache page is reused). Suite
metrics go to every logger as ``eval/<suite>/<metric>`` scalars, with ``eval/<suite>/count``
(the items scored, for confidence intervals) and ``eval/<suite>/seconds``; samples go to W&B
as a table when a W&B logger is attached, and always to ``<run dir>/eval_samples.jsonl``.

Evaluation happens on global rank 0 only, under a forked RNG, so it changes neither the
training randomness (exact resume stays bit-identical) nor the other ranks' work. Under
``trainer=fsdp2`` the engine runs on full weights gathered from the shards, a collective:
the other ranks take part in that gather at the same point (``PolicyEngine.join``) and go
on, while rank 0 evaluates on its gathered copy.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback

from astrai.eval import Suite, SuiteResult
from astrai.inference import InferenceEngine
from astrai.train.module import LMModule
from astrai.train.policy_engine import PolicyEngine

log = logging.getLogger(__name__)


class EvalCallback(Callback):
    """Run evaluation suites every N optimizer steps and log their metrics and samples.

    Args:
        suites: ``{name: Suite}``; the name is the metric namespace (``eval/<name>/...``).
            Hydra builds them from the ``conf/eval/`` group (see ``conf/callbacks/eval.yaml``).
        every_n_steps: optimizer steps between evaluations (0: only at start/end).
        at_start: also evaluate before the first step (the starting point of the curve).
        at_end: also evaluate after the last step.
        table_rows: samples per suite per evaluation in the table / JSONL.
        max_batch_size, max_seq_len: what this callback needs of the engine (``max_seq_len``
            None: what the suites need, capped by the model's context); the run's engine is
            built at the largest size any of its users needs.
        engine: the engine factory, called as ``engine(model, tokenizer, start=False,
            max_batch_size=..., max_seq_len=...)``: the ``engine`` group (conf/engine/) as
            a Hydra partial; None: :class:`~astrai.inference.InferenceEngine` itself. Used
            when the module's policy engine has no factory of its own (GRPO's has).
        samples_file: JSONL of samples, relative to the trainer's ``default_root_dir``.
        progress: show the suites' progress bars (on a terminal only): an evaluation pass
            can take minutes.
    """

    def __init__(
        self,
        suites: Mapping[str, Suite],
        *,
        every_n_steps: int = 100,
        at_start: bool = True,
        at_end: bool = True,
        table_rows: int = 16,
        max_batch_size: int = 32,
        max_seq_len: int | None = None,
        samples_file: str = "eval_samples.jsonl",
        engine: Callable[..., InferenceEngine] | None = None,
        progress: bool = True,
    ) -> None:
        super().__init__()
        self.suites = {str(k): v for k, v in dict(suites or {}).items() if v is not None}
        if not self.suites:
            raise ValueError("EvalCallback: no suites (give suites={name: Suite, ...})")
        for name, suite in self.suites.items():
            if not isinstance(suite, Suite):
                raise ValueError(
                    f"EvalCallback: suites.{name} must be an astrai.eval.Suite, got "
                    f"{type(suite).__name__} (a config node needs a _target_)"
                )
        self.every_n_steps = int(every_n_steps)
        self.at_start, self.at_end = bool(at_start), bool(at_end)
        self.table_rows = int(table_rows)
        self.max_batch_size = int(max_batch_size)
        self.max_seq_len = max_seq_len
        self.samples_file = samples_file
        self.progress = bool(progress)
        self.engine_factory: Callable[..., InferenceEngine] = engine or InferenceEngine
        # the module's policy engine; a module that is not an LMModule gets one of ours
        self.policy_engine: PolicyEngine | None = None
        self.last_step: int | None = None
        self.history: list[dict[str, Any]] = []  # metrics per evaluation (tests, notebooks)

    # ------------------------------------------------------------------ engine
    def engine_owner(self, pl_module: L.LightningModule) -> PolicyEngine:
        """The policy engine this callback uses (the module's), with its needs declared."""
        if self.policy_engine is None:
            if isinstance(pl_module, LMModule):
                owner = pl_module.policy_engine
            else:  # a plain LightningModule with a model and a tokenizer: one of our own
                owner = PolicyEngine(lambda: (pl_module.model, pl_module.tokenizer))
            model, tokenizer = owner.live()
            context = model.config.max_position_embeddings
            need = max(suite.required_seq_len(tokenizer) for suite in self.suites.values())
            owner.need(
                "evaluation callback",
                max_batch_size=self.max_batch_size,
                max_seq_len=self.max_seq_len or min(max(need, 64), context),
                factory=self.engine_factory,
            )
            self.policy_engine = owner
        return self.policy_engine

    @property
    def engine(self) -> InferenceEngine | None:
        """The engine this callback evaluates on, once built (None before, and after
        teardown)."""
        owner = self.policy_engine
        return owner.engine if owner is not None and owner.built else None

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        """Declare this callback's engine needs before anyone builds the engine."""
        if stage == "fit" and trainer.is_global_zero and self._usable(trainer, pl_module):
            self.engine_owner(pl_module)

    def _usable(self, trainer: L.Trainer, pl_module: L.LightningModule) -> bool:
        if getattr(pl_module, "tokenizer", None) is None:
            log.warning("EvalCallback: the module has no tokenizer; evaluation is off")
            return False
        from lightning.pytorch.strategies import FSDPStrategy

        if isinstance(trainer.strategy, FSDPStrategy):
            log.warning("EvalCallback: not supported with FSDP (sharded weights); off")
            return False
        return True

    # ------------------------------------------------------------------ evaluation
    def evaluate(self, trainer: L.Trainer, pl_module: L.LightningModule) -> dict[str, float]:
        """Run every suite once at the current step and log it (rank 0 only)."""
        step = int(trainer.global_step)
        self.last_step = step
        if not self._usable(trainer, pl_module):
            return {}
        if not trainer.is_global_zero:  # the weight gather of rank 0's sync (FSDP2) needs us
            if isinstance(pl_module, LMModule):
                pl_module.policy_engine.join(step)
            return {}
        log.info("evaluating %s at step %d", ", ".join(self.suites), step)  # can take minutes
        engine = self.engine_owner(pl_module).sync(step)
        device = pl_module.device
        devices = [device] if device.type == "cuda" else []
        metrics: dict[str, float] = {}
        with torch.random.fork_rng(devices=devices), torch.autocast(device.type, enabled=False):
            for name, suite in self.suites.items():
                result = suite.run(engine, progress=self.progress)
                metrics.update(suite_metrics(name, result))
                self._log_samples(trainer, name, result, step)
        self.history.append({"step": step, **metrics})
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=step)
        summary = ", ".join(f"{k}={v:.4g}" for k, v in metrics.items())
        log.info("evaluation at step %d: %s", step, summary)
        return metrics

    def _log_samples(self, trainer: L.Trainer, name: str, result: SuiteResult, step: int) -> None:
        shown = [{"step": step, "suite": name, **row} for row in result.samples[: self.table_rows]]
        if not shown:
            return
        path = Path(trainer.default_root_dir) / self.samples_file
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("a", encoding="utf-8") as f:
            for row in shown:
                f.write(json.dumps(row, ensure_ascii=False, default=str) + "\n")
        from lightning.pytorch.loggers import WandbLogger

        columns = list(dict.fromkeys(k for r in shown for k in r))  # first-seen order
        data = [[_cell(r.get(c)) for c in columns] for r in shown]
        for logger in trainer.loggers:
            if isinstance(logger, WandbLogger):
                logger.log_table(key=f"eval/{name}/samples", columns=columns, data=data, step=step)

    # ------------------------------------------------------------------ hooks
    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.at_start and not trainer.sanity_checking:
            self.evaluate(trainer, pl_module)

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, i: int
    ) -> None:
        step = trainer.global_step
        due = self.every_n_steps > 0 and step > 0 and step % self.every_n_steps == 0
        if due and step != self.last_step:  # once per optimizer step under accumulation
            self.evaluate(trainer, pl_module)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.at_end and trainer.global_step != self.last_step:
            self.evaluate(trainer, pl_module)

    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if self.policy_engine is not None:  # the module closes its own in its teardown
            if not isinstance(pl_module, LMModule):
                self.policy_engine.close()
            self.policy_engine = None


class ValidationStep(Callback):
    """Log the validation metrics (`val/*`) at `trainer.global_step`, the optimizer steps
    whose updates the weights hold: the index `EvalCallback`, the checkpoints (`step000050`)
    and the export use. Lightning would log them one lower (the last step's index, as it
    does train metrics), so `val/loss` and `eval/*` of the same weights would sit one step
    apart. Lightning reads a logged `step` as the x value of the epoch's other metrics."""

    def on_validation_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not trainer.sanity_checking:
            # (the same on every rank: the mean over ranks keeps it, without the warning
            # Lightning gives epoch-level values logged unsynced under DDP)
            pl_module.log("step", float(trainer.global_step), sync_dist=True)


def suite_metrics(name: str, result: SuiteResult) -> dict[str, float]:
    """A suite's result as logger scalars: ``eval/<name>/<metric>``, its item count and time."""
    out = {f"eval/{name}/{k}": float(v) for k, v in result.metrics.items()}
    out[f"eval/{name}/count"] = float(len(result.samples))
    out[f"eval/{name}/seconds"] = float(result.seconds)
    return out


def _cell(value: Any) -> Any:
    return json.dumps(value, default=str) if isinstance(value, list | dict) else value
