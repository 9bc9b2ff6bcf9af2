"""TRL's side of ``bench train_trl``: TRL's own ``SFTTrainer``, ``DPOTrainer`` and
``GRPOTrainer`` on the same checkpoint, tokens and batch as astrai's side, with its settings
matched: learning rate, AdamW betas / eps / weight decay (``adamw_torch``), a constant
schedule without warm-up, gradient clipping, one accumulation step, no gradient
checkpointing (TRL 1.16 turns it on by default), fp32, and no evaluation, saving, logging or
progress bar. GRPO generates with ``transformers`` (TRL's only backend on a CPU) with
``min_new_tokens = max_completion_length``: every completion is as long as astrai's.

Each trainer's class gets a small mixin that keeps every step's loss (the public
``compute_loss`` override point); a ``TrainerCallback`` stamps each step's end.
"""

from __future__ import annotations

import tempfile
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
from transformers import TrainerCallback

from astrai.bench.train_trl_data import (
    DPOData,
    GRPOData,
    SFTData,
    text_of,
    trl_even_token_reward,
)


class TRLStepClock(TrainerCallback):
    """When each optimizer step ended (wall clock and process CPU time)."""

    def __init__(self) -> None:
        self.stamps: list[float] = []
        self.cpu: list[float] = []

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if not self.stamps:  # the first step starts here
            self.stamps.append(time.perf_counter())
            self.cpu.append(time.process_time())

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.stamps.append(time.perf_counter())
        self.cpu.append(time.process_time())


class LossTap:
    """Keeps the loss of every ``compute_loss`` call (one per step: no accumulation)."""

    bench_losses: list[torch.Tensor]

    def compute_loss(
        self,
        model: Any,
        inputs: Any,
        return_outputs: bool = False,
        num_items_in_batch: Any = None,
    ) -> Any:
        out = super().compute_loss(  # type: ignore[misc]
            model, inputs, return_outputs=return_outputs, num_items_in_batch=num_items_in_batch
        )
        self.bench_losses.append((out[0] if return_outputs else out).detach())
        return out


def _common(cfg: Mapping[str, Any], out_dir: str, batch_size: int) -> dict[str, Any]:
    """The TrainingArguments every TRL config here shares (astrai's settings)."""
    optim = cfg["optim"]
    return {
        "output_dir": out_dir,
        "per_device_train_batch_size": batch_size,
        "gradient_accumulation_steps": 1,
        "learning_rate": float(optim["lr"]),
        "lr_scheduler_type": "constant",
        "warmup_steps": 0,
        "weight_decay": float(optim["weight_decay"]),
        "adam_beta1": float(optim["betas"][0]),
        "adam_beta2": float(optim["betas"][1]),
        "adam_epsilon": float(optim["eps"]),
        "optim": "adamw_torch",
        "max_grad_norm": float(cfg["gradient_clip_val"]),
        "max_steps": int(cfg["warmup_steps"]) + int(cfg["steps"]),
        "logging_strategy": "no",
        "save_strategy": "no",
        "eval_strategy": "no",
        "report_to": "none",
        "use_cpu": True,
        "bf16": False,
        "gradient_checkpointing": False,
        "seed": int(cfg["seed"]),
        "dataloader_num_workers": 0,
        "disable_tqdm": True,
        "model_init_kwargs": {"dtype": torch.float32},
    }


def _sft(
    cfg: Mapping[str, Any], data: SFTData, out: str, count: Callable[[int], None]
) -> tuple[Any, Any]:
    import trl
    from datasets import Dataset

    n, s = len(data.input_ids), len(data.input_ids[0])
    mask = [[0] * data.prompt_len + [1] * (s - data.prompt_len)] * n
    dataset = Dataset.from_dict({"input_ids": data.input_ids, "completion_mask": mask})
    args = trl.SFTConfig(
        **_common(cfg, out, n), completion_only_loss=True, max_length=s, packing=False
    )
    return trl.SFTTrainer, {"args": args, "train_dataset": dataset}


def _dpo(
    cfg: Mapping[str, Any], data: DPOData, out: str, count: Callable[[int], None]
) -> tuple[Any, Any]:
    import trl
    from datasets import Dataset

    dataset = Dataset.from_dict(
        {
            "prompt": [text_of(p) for p in data.prompts],
            "chosen": [text_of(c) for c in data.chosen],
            "rejected": [text_of(r) for r in data.rejected],
        }
    )
    strategy = cfg["dpo"]["strategy"]
    args = trl.DPOConfig(
        **_common(cfg, out, len(data.prompts)),
        beta=float(strategy["beta"]),
        loss_type=[str(strategy["loss_type"])],
        max_length=None,
    )
    return trl.DPOTrainer, {"args": args, "train_dataset": dataset}


def _grpo(
    cfg: Mapping[str, Any], data: GRPOData, out: str, count: Callable[[int], None]
) -> tuple[Any, Any]:
    import trl
    from datasets import Dataset

    g, s = cfg["grpo"], cfg["grpo"]["strategy"]
    group, new = int(g["num_generations"]), int(g["max_new_tokens"])
    args = trl.GRPOConfig(
        **_common(cfg, out, len(data.prompts) * group),
        num_generations=group,
        max_completion_length=new,
        generation_kwargs={"min_new_tokens": new},
        temperature=float(s["temperature"]),
        top_p=float(s["top_p"]),
        top_k=int(s["top_k"]),
        beta=float(s["kl_coef"]),
        loss_type=str(s["loss_type"]),
        epsilon=float(s["epsilon"]),
        use_bias_correction_kl=bool(s["use_bias_correction_kl"]),
        scale_rewards=str(s["scale_rewards"]),
        num_iterations=int(s["num_iterations"]),
        shuffle_dataset=False,
        log_completions=False,
    )
    dataset = Dataset.from_dict({"prompt": [text_of(p) for p in data.prompts]})
    return trl.GRPOTrainer, {
        "args": args,
        "train_dataset": dataset,
        "reward_funcs": counted_reward(count),
    }


def counted_reward(count: Callable[[int], None]) -> Callable[..., list[float]]:
    """TRL's reward function for the GRPO workload; it also hands each generation batch's
    completion token count to ``count`` (TRL scores a batch in one call)."""

    def even_token_reward(completions: list[str], completion_ids: list[list[int]], **kw: Any):
        count(sum(len(c) for c in completion_ids))
        return trl_even_token_reward(completions)

    return even_token_reward


BUILDERS = {"sft": _sft, "dpo": _dpo, "grpo": _grpo}


def run_trl(
    cfg: Mapping[str, Any],
    workload: str,
    data: Any,
    checkpoint: Path,
    count: Callable[[int], None],
) -> tuple[TRLStepClock, list[torch.Tensor]]:
    """``warmup_steps + steps`` optimizer steps of ``workload`` through TRL's trainer: the
    clock and every step's loss (GRPO: ``count`` gets each step's completion tokens)."""
    from transformers import AutoTokenizer

    torch.manual_seed(int(cfg["seed"]))
    clock = TRLStepClock()
    with tempfile.TemporaryDirectory() as tmp:
        trainer_cls, kwargs = BUILDERS[workload](cfg, data, tmp, count)
        tapped = type(f"Bench{trainer_cls.__name__}", (LossTap, trainer_cls), {})
        trainer = tapped(
            model=str(checkpoint),
            processing_class=AutoTokenizer.from_pretrained(checkpoint),
            callbacks=[clock],
            **kwargs,
        )
        trainer.bench_losses = []
        trainer.train()
    n = int(cfg["warmup_steps"]) + int(cfg["steps"])
    if len(clock.stamps) != n + 1 or len(trainer.bench_losses) != n:
        raise RuntimeError(
            f"bench train_trl: TRL ran {len(clock.stamps) - 1} steps "
            f"({len(trainer.bench_losses)} losses) of {n}"
        )
    return clock, trainer.bench_losses
