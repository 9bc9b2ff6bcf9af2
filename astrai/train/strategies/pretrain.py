"""Pretraining: next-token cross entropy over every labelled token.

Validation also logs corpus-level `val/ppl` and `val/bpb` (bits per UTF-8 byte, comparable
across tokenizers; `astrai.train.metrics`).
"""

from __future__ import annotations

from typing import Any

from torch import Tensor

from astrai.train.metrics import ValidationCorpusMetrics
from astrai.train.module import LMModule, check_label_smoothing, lm_loss


class PretrainModule(ValidationCorpusMetrics, LMModule):
    """Causal-LM pretraining; `label_smoothing` > 0 spreads that mass over the vocabulary
    (`val/loss` includes it; `val/ppl` and `val/bpb` are plain cross entropy). The other
    arguments are `LMModule`'s."""

    def __init__(self, *, label_smoothing: float = 0.0, **kwargs: Any) -> None:
        label_smoothing = check_label_smoothing(label_smoothing)  # before the model is built
        super().__init__(**kwargs)
        self.label_smoothing = label_smoothing

    def compute_loss(self, batch: dict[str, Any]) -> tuple[Tensor, dict[str, Tensor]]:
        logits = self.model(
            batch["input_ids"],
            position_ids=batch.get("position_ids"),
            attention_mask=batch.get("attention_mask"),
        )
        loss, n = lm_loss(logits, batch["labels"], label_smoothing=self.label_smoothing)
        self.tally_validation(logits, batch["labels"])
        return loss, {"tokens": n.float()}
