"""Generation-based evaluation during training: the metric a loss curve cannot show.

Every ``every_n_steps`` optimizer steps the callback generates completions for a fixed set of
prompts with an :class:`~astrai.inference.InferenceEngine` that runs on the *live* policy
weights (built once, ``start=False``, synchronous ``run_batch`` on the training thread; its
policy version is advanced before every use so no stale prefix-cache page is reused). Task
metrics (rewards from :mod:`astrai.data.rewards`, e.g. exact-match accuracy) go to every
logger as ``eval/<metric>`` scalars; the samples go to W&B as a table when a W&B logger is
attached, and always to ``<run dir>/eval_samples.jsonl``.

Generation happens on global rank 0 only, under a forked RNG, so it changes neither the
training randomness (exact resume stays bit-identical) nor the other ranks' work.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback

from astrai.data.builtin import arithmetic_problems, stdlib_records
from astrai.data.rewards import get_reward
from astrai.inference import InferenceEngine

log = logging.getLogger(__name__)

TASKS = ("arithmetic", "stdlib")


def builtin_prompts(
    task: str, n: int, seed: int = 0, **options: Any
) -> tuple[list[dict[str, Any]], bool]:
    """Fixed evaluation records of a built-in task and whether they are chat-shaped.

    ``arithmetic``: held-out (val split) problems with their ``answer`` (``options`` go to
    ``arithmetic_problems``, e.g. ``max_operand``, ``ops``); ``stdlib``: the first lines of
    held-out standard-library files, as raw-text prompts for pretrained models.
    """
    if task == "arithmetic":
        options.setdefault("unique", True)  # n distinct held-out problems
        problems = arithmetic_problems(n, seed=seed, split="val", **options)
        return [{"prompt": p["prompt"], "answer": p["answer"]} for p in problems], True
    if task == "stdlib":
        out = []
        for rec in stdlib_records("val"):
            lines = [ln for ln in rec["text"].splitlines() if ln.strip()][:3]
            if lines:
                out.append({"prompt": "\n".join(lines) + "\n", "path": rec["path"]})
            if len(out) >= n:
                break
        return out, False
    raise ValueError(f"EvalGenerationCallback: unknown task {task!r}; choose one of {TASKS}")


def _records(prompts: Sequence[Any]) -> list[dict[str, Any]]:
    out = []
    for p in prompts:
        if isinstance(p, str):
            out.append({"prompt": p})
        elif isinstance(p, Mapping) and ("prompt" in p or "messages" in p):
            out.append(dict(p))
        else:
            raise ValueError(
                f"EvalGenerationCallback: a prompt must be a string or a record with 'prompt' "
                f"or 'messages', got {p!r}"
            )
    return out


class EvalGenerationCallback(Callback):
    """Generate for fixed prompts every N optimizer steps and log samples and task metrics.

    Args:
        prompts: strings, or records ``{"prompt": str | messages, "answer": ...}`` /
            ``{"messages": [...]}`` (extra fields go to the metric functions).
        task: instead of ``prompts``, a built-in set: ``arithmetic`` or ``stdlib``.
        num_prompts: how many built-in prompts.
        task_options: options of the built-in task (arithmetic: ``max_operand``, ``ops``, ...).
        every_n_steps: optimizer steps between evaluations (0: only at start/end).
        max_tokens, temperature, top_p, top_k, seed: sampling (temperature 0 = greedy).
        metric: reward name(s) from ``astrai.data.rewards`` logged as ``eval/<name>``
            (``None``: samples only). Records without the fields a metric needs are skipped.
        chat: render prompts with the tokenizer's chat template (``None``: chat for the
            arithmetic task and for ``messages`` records, raw text otherwise).
        at_start: also evaluate before the first step (the starting point of the curve).
        at_end: also evaluate after the last step.
        table_rows: samples per table / JSONL entry.
        max_batch_size, max_seq_len: engine sizes, passed to ``engine`` at the call
            (``max_seq_len`` None: the longest prompt plus ``max_tokens``).
        engine: the engine factory, called as ``engine(model, tokenizer, start=False,
            max_batch_size=..., max_seq_len=...)``: the ``engine`` group (conf/engine/) as
            a Hydra partial; None: :class:`~astrai.inference.InferenceEngine` itself.
        samples_file: JSONL of samples, relative to the trainer's ``default_root_dir``.
    """

    def __init__(
        self,
        prompts: Sequence[Any] | None = None,
        *,
        task: str | None = None,
        num_prompts: int = 32,
        task_options: Mapping[str, Any] | None = None,
        every_n_steps: int = 100,
        max_tokens: int = 64,
        temperature: float = 0.0,
        top_p: float = 1.0,
        top_k: int = 0,
        seed: int = 0,
        metric: str | Sequence[str] | None = "exact_match",
        chat: bool | None = None,
        at_start: bool = True,
        at_end: bool = True,
        table_rows: int = 16,
        max_batch_size: int = 32,
        max_seq_len: int | None = None,
        samples_file: str = "eval_samples.jsonl",
        engine: Callable[..., InferenceEngine] | None = None,
    ) -> None:
        super().__init__()
        if (prompts is None) == (task is None):
            raise ValueError("EvalGenerationCallback: give exactly one of `prompts` or `task`")
        if prompts is not None:
            self.records = _records(list(prompts))
            default_chat = any("messages" in r for r in self.records)
        else:
            self.records, default_chat = builtin_prompts(
                str(task), num_prompts, seed, **dict(task_options or {})
            )
        if not self.records:
            raise ValueError("EvalGenerationCallback: no prompts")
        self.chat = default_chat if chat is None else bool(chat)
        self.every_n_steps = int(every_n_steps)
        self.sampling = {
            "max_tokens": int(max_tokens),
            "temperature": float(temperature),
            "top_p": float(top_p),
            "top_k": int(top_k),
        }
        self.seed = int(seed)
        metrics = [metric] if isinstance(metric, str) else list(metric or [])
        self.metrics = {name: get_reward(name) for name in metrics}  # unknown names fail now
        self.at_start, self.at_end = bool(at_start), bool(at_end)
        self.table_rows = int(table_rows)
        self.max_batch_size = int(max_batch_size)
        self.max_seq_len = max_seq_len
        self.samples_file = samples_file
        self.engine_factory: Callable[..., InferenceEngine] = engine or InferenceEngine
        self._engine: InferenceEngine | None = None
        self._prompt_ids: list[list[int]] | None = None
        self._last_step: int | None = None
        self.history: list[dict[str, Any]] = []  # metrics per evaluation (tests, notebooks)

    # ------------------------------------------------------------------ prompts and engine
    def _encode(self, tokenizer: Any) -> list[list[int]]:
        ids = []
        for rec in self.records:
            prompt = rec.get("messages", rec.get("prompt"))
            if self.chat:
                msgs = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
                ids.append(
                    list(
                        tokenizer.apply_chat_template(
                            msgs, add_generation_prompt=True, tokenize=True
                        )
                    )
                )
            else:
                if not isinstance(prompt, str):
                    raise ValueError("EvalGenerationCallback: chat=false needs string prompts")
                ids.append(list(tokenizer.encode(prompt)))
        return ids

    def _get_engine(self, pl_module: L.LightningModule) -> InferenceEngine:
        if self._engine is None:
            model, tokenizer = pl_module.model, pl_module.tokenizer
            self._prompt_ids = self._encode(tokenizer)
            longest = max(len(p) for p in self._prompt_ids) + self.sampling["max_tokens"]
            max_seq_len = self.max_seq_len or min(
                max(longest, 64), model.config.max_position_embeddings
            )
            self._engine = self.engine_factory(
                model,
                tokenizer,
                start=False,
                max_batch_size=min(self.max_batch_size, len(self._prompt_ids)),
                max_seq_len=max_seq_len,
            )
        return self._engine

    # ------------------------------------------------------------------ evaluation
    def _usable(self, trainer: L.Trainer, pl_module: L.LightningModule) -> bool:
        if getattr(pl_module, "tokenizer", None) is None:
            log.warning("EvalGenerationCallback: the module has no tokenizer; disabled")
            return False
        from lightning.pytorch.strategies import FSDPStrategy

        if isinstance(trainer.strategy, FSDPStrategy):
            log.warning("EvalGenerationCallback: not supported with FSDP (sharded weights); off")
            return False
        return True

    def evaluate(self, trainer: L.Trainer, pl_module: L.LightningModule) -> dict[str, float]:
        """Generate, score and log once at the current step (rank 0 only)."""
        step = int(trainer.global_step)
        self._last_step = step
        if not trainer.is_global_zero or not self._usable(trainer, pl_module):
            return {}
        engine = self._get_engine(pl_module)
        if step > engine.policy_version:
            engine.update_weights(version=step)
        started = time.perf_counter()
        device = pl_module.device
        devices = [device] if device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices), torch.autocast(device.type, enabled=False):
            results = engine.run_batch(
                self._prompt_ids, seed=self.seed, return_details=True, **self.sampling
            )
        seconds = time.perf_counter() - started
        tokenizer = pl_module.tokenizer
        rows, scores = [], {name: [] for name in self.metrics}
        for rec, res in zip(self.records, results):
            text = tokenizer.decode(res.token_ids, skip_special_tokens=True)
            row: dict[str, Any] = {
                "step": step,
                "prompt": rec.get("prompt", rec.get("messages")),
                "completion": text,
                "finish_reason": res.finish_reason,
            }
            if "answer" in rec:
                row["answer"] = rec["answer"]
            for name, fn in self.metrics.items():
                try:
                    value = float(fn(rec, text))
                except KeyError:  # the record lacks a field this metric needs
                    continue
                row[name] = value
                scores[name].append(value)
            rows.append(row)
        metrics = {f"eval/{k}": sum(v) / len(v) for k, v in scores.items() if v}
        metrics["eval/completion_len"] = sum(len(r.token_ids) for r in results) / len(results)
        metrics["eval/seconds"] = seconds
        self.history.append({"step": step, **metrics})
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=step)
        self._log_samples(trainer, rows, step)
        summary = ", ".join(f"{k}={v:.4g}" for k, v in metrics.items())
        log.info("eval generation at step %d: %s", step, summary)
        return metrics

    def _log_samples(self, trainer: L.Trainer, rows: list[dict[str, Any]], step: int) -> None:
        shown = rows[: self.table_rows]
        path = Path(trainer.default_root_dir) / self.samples_file
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("a", encoding="utf-8") as f:
            for row in shown:
                f.write(json.dumps(row, ensure_ascii=False, default=str) + "\n")
        try:
            from lightning.pytorch.loggers import WandbLogger
        except ImportError:  # pragma: no cover - wandb is a dependency
            return
        columns = list(dict.fromkeys(k for r in shown for k in r))  # first-seen order
        for logger in trainer.loggers:
            if isinstance(logger, WandbLogger):
                data = [
                    [
                        json.dumps(r.get(c), default=str)
                        if isinstance(r.get(c), list | dict)
                        else r.get(c)
                        for c in columns
                    ]
                    for r in shown
                ]
                logger.log_table(key="eval/samples", columns=columns, data=data, step=step)

    # ------------------------------------------------------------------ hooks
    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.at_start and not trainer.sanity_checking:
            self.evaluate(trainer, pl_module)

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, i: int
    ) -> None:
        step = trainer.global_step
        due = self.every_n_steps > 0 and step > 0 and step % self.every_n_steps == 0
        if due and step != self._last_step:  # once per optimizer step under accumulation
            self.evaluate(trainer, pl_module)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.at_end and trainer.global_step != self._last_step:
            self.evaluate(trainer, pl_module)

    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if self._engine is not None:
            self._engine.shutdown()
            self._engine = None
