"""The weights of any optimizer step of a ledger run, without keeping every checkpoint.

`Rebuilder.at(K)` returns the run's module as it was after step K: step 0 is the start the
run's seed builds (checked against the ledger's start digest); a step with a checkpoint is
loaded from it; any other step is the newest checkpoint before it plus a ledger replay of the
steps in between (`astrai.train.replay`: GRPO's rollouts come from the ledger, so no engine
samples), each replayed step checked against its ledger row (loss, gradient norm, weights,
random state, batch). A state the rebuilder replayed is kept as a scratch checkpoint (in a
temporary folder, never in the run's), so a later rebuild continues from the nearest state it
already has: a bisection re-runs each step at most a few times.

`Rebuilder.variant(K, change)` re-runs step K alone from the state after step K-1 with its
batch changed (a rollout group or a slice of the batch left out: `astrai.train.attribute`),
unchecked: the counterfactual step.
"""

from __future__ import annotations

import logging
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback

from astrai.train.ledger import weights_digest
from astrai.train.ledger_store import LedgerFile
from astrai.train.replay import (
    ReplayError,
    StepCheck,
    check_start,
    checkpoint_steps,
    fit_from,
    load_run_config,
    rebuild_start,
    replay_callback,
)

log = logging.getLogger(__name__)

__all__ = ["Rebuilder", "StopAt"]


class StopAt(Callback):
    """Saves the state at the end of optimizer step ``step`` (where Lightning's own
    checkpoint callback saves, so resuming from it is the same as from a run's checkpoint)
    and stops the fit there."""

    def __init__(self, step: int, path: Path | None) -> None:
        self.step = int(step)
        self.path = path

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, i: int
    ) -> None:
        if int(trainer.global_step) < self.step:
            return
        if self.path is not None and not self.path.exists():
            trainer.save_checkpoint(self.path)
        trainer.should_stop = True


class Rebuilder:
    """Rebuilds states of one run (``ledger=true``). Use as a context manager: the scratch
    checkpoints are removed on exit.

    Args:
        run: the run folder (``.hydra/config.yaml``, ``ledger.h5``, ``checkpoints/``).
        keep: scratch checkpoints kept at once (the oldest go first).
    """

    def __init__(self, run: str | Path, keep: int = 8) -> None:
        self.run = Path(run)
        if not (self.run / "ledger.h5").is_file():
            raise ReplayError(f"{self.run}: no ledger.h5 (train with ledger=true)")
        self.cfg = load_run_config(self.run)
        self.ledger = LedgerFile(self.run / "ledger.h5")
        self.meta = self.ledger.meta
        self.steps = list(self.ledger.steps)
        if int(self.meta.get("world_size", 1)) != 1:
            raise ReplayError(
                f"{self.ledger.path}: the run had {self.meta['world_size']} ranks; rebuilding "
                "re-runs steps in one process and needs a one-process run"
            )
        self.scratch = Path(tempfile.mkdtemp(prefix="astrai-rebuild-"))
        self.keep = int(keep)
        self.replayed = 0  # optimizer steps re-run so far (the cost)
        candidates = sorted((self.run / "checkpoints").glob("*.ckpt"))
        if self.meta.get("resumed_from"):
            candidates.append(Path(self.meta["resumed_from"]))
        self.states: dict[int, Path] = {}
        for path, step in checkpoint_steps(candidates).items():
            if step >= 0:
                self.states.setdefault(step, path)
        self.saved: list[int] = []
        self.tokenizer: Any = None

    @property
    def last_step(self) -> int:
        return max(self.steps) if self.steps else 0

    def check_step(self, step: int) -> None:
        if step != 0 and step not in set(self.steps):
            span = f"{min(self.steps)}..{max(self.steps)}" if self.steps else "none"
            raise ReplayError(f"{self.ledger.path}: step {step} is not in the ledger ({span})")

    # ------------------------------------------------------------------ states
    def _nearest(self, step: int) -> tuple[Path | None, int]:
        """The newest state at or before ``step``: ``(checkpoint, its step)``; ``(None, 0)``
        is the start."""
        found = [s for s in self.states if s <= step]
        if not found:
            start = int(self.meta.get("start_step", 0))
            if start != 0:
                raise ReplayError(
                    f"{self.run / 'checkpoints'}: no checkpoint at or before step {step}, and "
                    f"the ledger starts at step {start} (resumed from {self.meta.get('resumed_from')})"
                )
            return None, 0
        s = max(found)
        return self.states[s], s

    def _remember(self, step: int, path: Path) -> None:
        self.states[step] = path
        self.saved.append(step)
        while len(self.saved) > self.keep:
            old = self.saved.pop(0)
            self.states.pop(old).unlink(missing_ok=True)

    def _built(self) -> tuple[Any, Any]:
        datamodule, module = rebuild_start(self.cfg, self.meta)
        self.tokenizer = module.tokenizer
        return datamodule, module

    def at(self, step: int) -> L.LightningModule:
        """The module after optimizer step ``step`` (0: the start), its weights checked
        against the ledger's digest of that step."""
        self.check_step(step)
        ckpt, at = self._nearest(step)
        datamodule, module = self._built()
        if ckpt is None and step == 0:
            check_start(module, self.meta)
            return module
        if at == step:  # a checkpoint of exactly this step
            state = torch.load(ckpt, map_location="cpu", weights_only=False)
            module.on_load_checkpoint(state)
            module.load_state_dict(state["state_dict"])
            self._check_weights(module, step)
            return module
        if ckpt is None:
            check_start(module, self.meta)
        log.info(
            "rebuilding step %d: replaying steps %d..%d from %s",
            step,
            at + 1,
            step,
            ckpt or "the start",
        )
        checks: list[StepCheck] = []
        path = self.scratch / f"step{step:06d}.ckpt"
        callbacks = [replay_callback(self.ledger, step, checks), StopAt(step, path)]
        fit_from(self.cfg, datamodule, module, ckpt, callbacks)
        self.replayed += len(checks)
        bad = [c for c in checks if not c.ok]
        if bad:
            raise ReplayError(
                f"rebuilding step {step}: step {bad[0].step} differs from the ledger "
                f"({', '.join(bad[0].mismatches)}); these weights are not the run's"
            )
        if not checks or checks[-1].step != step:
            raise ReplayError(f"rebuilding step {step}: the replay stopped before it")
        if path.exists():
            self._remember(step, path)
        return module

    def _check_weights(self, module: L.LightningModule, step: int) -> None:
        recorded = self.ledger.step(step)["weights_digest"]
        if recorded and weights_digest(module.state_dict().items()) != recorded:
            raise ReplayError(
                f"step {step}: the checkpoint's weights differ from the ledger's digest"
            )

    def variant(self, step: int, change: Callable[[], Callback]) -> L.LightningModule:
        """Step ``step`` re-run alone from the state after step ``step - 1`` with the callback
        ``change()`` altering its batch (not checked against the ledger: a counterfactual)."""
        self.check_step(step)
        if step < 1:
            raise ReplayError("a variant re-runs a step: step >= 1")
        if step - 1 not in self.states and step - 1 != 0:
            self.at(step - 1).cpu()  # keeps a scratch checkpoint of step - 1
        ckpt = self.states.get(step - 1)
        datamodule, module = self._built()
        if ckpt is None:
            check_start(module, self.meta)
        callbacks = [replay_callback(self.ledger, step, [], checked=False), change()]
        fit_from(self.cfg, datamodule, module, ckpt, callbacks)
        self.replayed += 1
        return module

    # ------------------------------------------------------------------ end
    def close(self) -> None:
        self.ledger.close()
        shutil.rmtree(self.scratch, ignore_errors=True)

    def __enter__(self) -> Rebuilder:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
