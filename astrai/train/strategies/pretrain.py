"""Pretraining: next-token cross entropy over every labelled token.

Validation also logs corpus-level `val/ppl` and `val/bpb` (bits per UTF-8 byte, comparable
across tokenizers; `astrai.train.metrics`).
"""

from __future__ import annotations

from typing import Any

from torch import Tensor

from astrai.train.metrics import ValidationCorpusMetrics
from astrai.train.module import LMModule


class PretrainModule(ValidationCorpusMetrics, LMModule):
    """Causal-LM pretraining; `label_smoothing` > 0 (an `LMModule` argument) spreads that mass
    over the vocabulary (`val/loss` includes it; `val/ppl` and `val/bpb` are plain cross
    entropy)."""

    def compute_loss(self, batch: dict[str, Any]) -> tuple[Tensor, dict[str, Tensor]]:
        loss, n, scores = self.token_loss(
            batch["input_ids"],
            batch["labels"],
            position_ids=batch.get("position_ids"),
            attention_mask=batch.get("attention_mask"),
            cu_seqlens=batch.get("cu_seqlens"),
        )
        self.tally_validation(-scores.logp, batch["labels"])
        return loss, {"tokens": n.float()}
