"""astrai's side of ``bench train_trl``: each workload through the real training path, the
strategy LightningModule built by the training entry point's ``instantiate_strategy`` (its
optimizer and schedule from the ``optim`` group) on the imported Qwen3 checkpoint, and a
Lightning ``Trainer`` with gradient clipping; no logger, checkpoint, progress bar or
validation (TRL's side has none either). GRPO's rollouts come from the module's own engine,
with ``ignore_eos`` so that every completion is ``max_new_tokens`` long (TRL:
``min_new_tokens``)."""

from __future__ import annotations

import dataclasses
import tempfile
import warnings
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import lightning as L
import torch
from omegaconf import OmegaConf
from torch.utils.data import DataLoader

from astrai.bench.train import StepClock
from astrai.bench.train_trl_data import PAD_ID, DPOData, GRPOData, SFTData
from astrai.data.datasets import IGNORE_INDEX, collate_preference, collate_prompt
from astrai.train.runner import instantiate_strategy
from astrai.train.strategies.grpo.source import RolloutSource, WrappingSource


class RolloutTokens(L.Callback):
    """Hands the completion tokens of each GRPO generation batch to ``add`` (a rollout
    observer of the module, from ``setup`` on)."""

    def __init__(self, add: Callable[[int], None]) -> None:
        self.add = add

    def setup(self, trainer: L.Trainer, pl_module: Any, stage: str) -> None:
        def observe(step: int, samples: Any, advantages: Any) -> None:
            self.add(sum(len(c) for c in samples.completions))

        pl_module.observe_rollouts(observe)


def sft_batch(data: SFTData) -> dict[str, torch.Tensor]:
    """All ``seq_len`` ids in (as TRL forwards them); labels are the next ids, none on the
    prompt's and none after the last id."""
    ids = torch.tensor(data.input_ids)
    labels = torch.full_like(ids, IGNORE_INDEX)
    labels[:, data.prompt_len - 1 : -1] = ids[:, data.prompt_len :]
    return {"input_ids": ids, "labels": labels}


def dpo_batch(data: DPOData) -> dict[str, torch.Tensor]:
    """Chosen and rejected rows as the preference dataset gives them, but with every id in
    (TRL forwards prompt + response whole): labels and loss mask on the response's ids."""
    items = []
    for prompt, chosen, rejected in zip(data.prompts, data.chosen, data.rejected):
        item: dict[str, torch.Tensor] = {}
        for side, response in (("chosen", chosen), ("rejected", rejected)):
            ids = torch.tensor(prompt + response)
            mask = torch.zeros(len(ids), dtype=torch.bool)
            mask[len(prompt) - 1 : -1] = True
            labels = torch.full_like(ids, IGNORE_INDEX)
            labels[:-1] = ids[1:].masked_fill(~mask[:-1], IGNORE_INDEX)
            item.update(
                {f"{side}_input_ids": ids, f"{side}_labels": labels, f"{side}_loss_mask": mask}
            )
        items.append(item)
    return collate_preference(items, pad_id=PAD_ID)


def grpo_batch(data: GRPOData) -> dict[str, Any]:
    """The prompt loader's batch (``collate_prompt``), records empty."""
    items = [{"prompt_ids": torch.tensor(p), "record": {}} for p in data.prompts]
    return collate_prompt(items, pad_id=PAD_ID)


BATCHES: dict[str, Callable[[Any], dict[str, Any]]] = {
    "sft": sft_batch,
    "dpo": dpo_batch,
    "grpo": grpo_batch,
}


class IgnoreEOS(WrappingSource):
    """The module's engine source sampling with ``ignore_eos``: every completion is
    ``max_new_tokens`` long, as TRL's with ``min_new_tokens = max_new_tokens``."""

    def __init__(self, inner: RolloutSource, module: Any) -> None:
        super().__init__(inner)
        params = dataclasses.replace(module.live_source.params, ignore_eos=True)
        self.source = module.engine_source(module.rollout_engine, params)

    def take(self, batch: Mapping[str, Any], seed: int, step: int) -> Any:
        samples = self.source.take(batch, seed, step)
        self.waited = self.source.waited
        return samples

    def close(self) -> None:
        self.source.close()
        super().close()


def build_module(cfg: Mapping[str, Any], workload: str, checkpoint: Path) -> Any:
    """The workload's strategy module on the checkpoint (weights and tokenizer)."""
    spec = OmegaConf.create(
        {
            "strategy": cfg[workload]["strategy"],
            "optim": cfg["optim"],
            "model": {
                "_target_": "astrai.model.pretrained_model",
                "_partial_": True,
                "path": str(checkpoint),
            },
        }
    )
    module = instantiate_strategy(spec, checkpoint)
    if workload == "grpo":
        module.wrap_source(lambda inner: IgnoreEOS(inner, module))
    return module


def run_astrai(
    cfg: Mapping[str, Any],
    workload: str,
    data: Any,
    checkpoint: Path,
    callbacks: list[L.Callback] | None = None,
) -> StepClock:
    """``warmup_steps + steps`` optimizer steps of ``workload`` on its one batch; the clock
    (``callbacks``: e.g. the GRPO profiler, which sees the module)."""
    torch.manual_seed(int(cfg["seed"]))
    module = build_module(cfg, workload, checkpoint)
    batch = BATCHES[workload](data)
    n = int(cfg["warmup_steps"]) + int(cfg["steps"])
    clock = StepClock(torch.device("cpu"), from_first_start=True)
    loader = DataLoader([batch] * n, batch_size=None, shuffle=False, num_workers=0)
    with tempfile.TemporaryDirectory() as tmp, warnings.catch_warnings():
        warnings.filterwarnings("ignore", ".*does not have many workers.*")
        trainer = L.Trainer(
            accelerator="cpu",
            devices=1,
            precision="32-true",
            max_steps=n,
            gradient_clip_val=cfg["gradient_clip_val"],
            logger=False,
            callbacks=[clock, *(callbacks or [])],
            enable_progress_bar=False,
            enable_checkpointing=False,
            enable_model_summary=False,
            limit_val_batches=0,
            num_sanity_val_steps=0,
            default_root_dir=tmp,
        )
        trainer.fit(module, train_dataloaders=loader)
    if len(clock.losses) != n:
        raise RuntimeError(f"bench train_trl: Lightning ran {len(clock.losses)} of {n} steps")
    return clock
