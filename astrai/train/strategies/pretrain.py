"""Pretraining: next-token cross entropy over every labelled token."""

from __future__ import annotations

from typing import Any

import torch.nn.functional as F
from torch import Tensor

from astrai.data.datasets import IGNORE_INDEX
from astrai.train.module import LMModule


def lm_loss(
    logits: Tensor, labels: Tensor, *, label_smoothing: float = 0.0
) -> tuple[Tensor, Tensor]:
    """Mean cross entropy over tokens whose label is not `IGNORE_INDEX`, and their count.

    Labels are already shifted by the datasets (`labels[t]` follows `input_ids[t]`).
    """
    n = (labels != IGNORE_INDEX).sum()
    loss = F.cross_entropy(
        logits.float().flatten(0, 1),
        labels.flatten(),
        ignore_index=IGNORE_INDEX,
        label_smoothing=label_smoothing,
    )
    return loss, n


class PretrainModule(LMModule):
    """Causal-LM pretraining; `label_smoothing` > 0 spreads that mass over the vocabulary."""

    def __init__(self, *args: Any, label_smoothing: float = 0.0, **kwargs: Any) -> None:
        super().__init__(*args, label_smoothing=label_smoothing, **kwargs)
        if not 0.0 <= label_smoothing < 1.0:
            raise ValueError(f"strategy.label_smoothing: must be in [0, 1), got {label_smoothing}")
        self.label_smoothing = float(label_smoothing)

    def compute_loss(self, batch: dict[str, Any]) -> tuple[Tensor, dict[str, Tensor]]:
        logits = self.model(
            batch["input_ids"],
            position_ids=batch.get("position_ids"),
            attention_mask=batch.get("attention_mask"),
        )
        loss, n = lm_loss(logits, batch["labels"], label_smoothing=self.label_smoothing)
        return loss, {"tokens": n.float()}
