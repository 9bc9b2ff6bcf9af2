"""Supervised fine-tuning: cross entropy on assistant tokens only.

The SFT datasets set `labels` to `IGNORE_INDEX` wherever `loss_mask` is 0 (system, user and
tool turns, template tokens, padding), and packed documents restart their `position_ids`,
which the model turns into a block-diagonal attention mask: no token attends across
documents. LoRA (`lora:` in the strategy config) trains adapters only; exports merge them.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor

from astrai.data.datasets import IGNORE_INDEX
from astrai.train.module import LMModule


class SFTModule(LMModule):
    """Assistant-only cross entropy (mean over assistant tokens of the batch, with the
    `LMModule`'s `label_smoothing`)."""

    def compute_loss(self, batch: dict[str, Any]) -> tuple[Tensor, dict[str, Tensor]]:
        labels = batch["labels"]
        if "loss_mask" in batch:  # belt and braces: never learn from a masked position
            labels = labels.masked_fill(~batch["loss_mask"].bool(), IGNORE_INDEX)
        loss, n, _ = self.token_loss(
            batch["input_ids"],
            labels,
            position_ids=batch.get("position_ids"),
            attention_mask=batch.get("attention_mask"),
            cu_seqlens=batch.get("cu_seqlens"),
        )
        return loss, {"assistant_tokens": n.float()}
