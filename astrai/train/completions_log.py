"""GRPO's (and PPO's) sampled completions with their rewards, as TRL's `log_completions`
shows them: a few rows of a generation batch every `every_n_steps` optimizer steps, always
appended to `<run dir>/completions.jsonl` and, when a W&B logger is attached, logged as a
`wandb.Table` under `completions`.

A row is one completion: `step` (the optimizer step whose weights sampled it), `prompt` and
`completion` (decoded), `reward` (the total the advantages were computed from), one column
per reward function (its unweighted value, as TRL's table has them), `advantage` (the
completion's; a per-token estimator's is averaged over the completion's tokens) and
`truncated`. Rows come from the first `num_completions_to_print` completions of the batch
(prompt-major: whole groups first; None: all of them). Under several processes rank 0 logs
its own rollouts.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.loggers import WandbLogger

from astrai.train.strategies.grpo.sampling import Samples
from astrai.train.strategies.grpo.source import RolloutModule

__all__ = ["CompletionsLog", "completion_rows"]

log = logging.getLogger(__name__)

#: the W&B table's key
TABLE_KEY = "completions"


def completion_rows(
    step: int, samples: Samples, advantages: torch.Tensor, decode: Any, limit: int | None
) -> list[dict[str, Any]]:
    """The log's rows for the first `limit` completions of `samples` (all when None)."""
    adv = advantages.detach().float().cpu()
    count = len(samples.completions) if limit is None else min(limit, len(samples.completions))
    rows = []
    for i in range(count):
        completion = samples.completions[i]
        value = adv[i] if adv.dim() == 1 else adv[i, : max(len(completion), 1)].mean()
        rows.append(
            {
                "step": step,
                "prompt": decode(samples.prompts[i]),
                "completion": decode(completion),
                "reward": float(samples.rewards[i]),
                **{name: float(col[i]) for name, col in samples.reward_columns.items()},
                "advantage": float(value),
                "truncated": bool(samples.truncated[i]),
            }
        )
    return rows


class CompletionsLog(Callback):
    """Writes sampled completions (see the module's docstring); a no-op for a module that
    trains on no rollouts, or with `log_completions=false`. TRL's names: `log_completions`,
    `num_completions_to_print`."""

    def __init__(
        self,
        path: str | Path,
        log_completions: bool = True,
        every_n_steps: int = 10,
        num_completions_to_print: int | None = 8,
    ) -> None:
        if every_n_steps < 1:
            raise ValueError(
                f"callbacks.completions.every_n_steps: {every_n_steps} is not a positive "
                "number of optimizer steps"
            )
        if num_completions_to_print is not None and num_completions_to_print < 1:
            raise ValueError(
                f"callbacks.completions.num_completions_to_print: {num_completions_to_print} "
                "is not a positive count (null: every completion of the batch)"
            )
        self.path = Path(path)
        self.log_completions = log_completions
        self.every_n_steps = every_n_steps
        self.num_completions_to_print = num_completions_to_print
        self.next_step = 0  # the first rollout at or after this step is logged
        self._trainer: L.Trainer | None = None
        self._decode: Any = None

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if stage == "fit" and self.log_completions and isinstance(pl_module, RolloutModule):
            self._trainer = trainer
            self._decode = pl_module.tokenizer.decode
            pl_module.observe_rollouts(self.observe)

    def observe(self, step: int, samples: Samples, advantages: torch.Tensor) -> None:
        """A generation batch: logged when it is the first at or after the next due step."""
        trainer = self._trainer
        if trainer is None or step < self.next_step or trainer.sanity_checking:
            return
        self.next_step = (step // self.every_n_steps + 1) * self.every_n_steps
        if not trainer.is_global_zero:
            return
        rows = completion_rows(
            step, samples, advantages, self._decode, self.num_completions_to_print
        )
        self.write(rows)
        self._table(trainer.loggers, rows, step)

    def write(self, rows: Sequence[dict[str, Any]]) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self.path.open("a", encoding="utf-8") as f:
            for row in rows:
                f.write(json.dumps(row, ensure_ascii=False) + "\n")

    def _table(self, loggers: Sequence[Any], rows: Sequence[dict[str, Any]], step: int) -> None:
        if not rows:
            return
        columns = list(dict.fromkeys(k for r in rows for k in r))
        data = [[r.get(c) for c in columns] for r in rows]
        for logger in loggers:
            if isinstance(logger, WandbLogger):
                logger.log_table(key=TABLE_KEY, columns=columns, data=data, step=step)

    def state_dict(self) -> dict[str, Any]:
        return {"next_step": self.next_step}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.next_step = int(state_dict["next_step"])
