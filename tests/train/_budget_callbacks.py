"""Test-only callback for the token-budget runs (`tests/train/test_budget_resume.py`), loaded by
`python -m astrai.train` through `+callbacks.rows._target_=_budget_callbacks.PackedRows` with
this folder on PYTHONPATH."""

from __future__ import annotations

import hashlib
import itertools
import json
from pathlib import Path
from typing import Any

from lightning.pytorch.callbacks import Callback


def _digest(tensor: Any) -> str:
    return hashlib.sha1(tensor.cpu().numpy().tobytes()).hexdigest()[:16]


class PackedRows(Callback):
    """Append, for every training step of every rank, the padding-free row it trained on to
    the JSON-lines file `path`: its shape and a digest of each of its samples (position ids
    restart at 0 at every sample)."""

    def __init__(self, path: str) -> None:
        self.path = Path(path)

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, *args: Any) -> None:
        batch = args[0]
        ids, starts = batch["input_ids"][0], (batch["position_ids"][0] == 0).nonzero()[:, 0]
        bounds = [*starts.tolist(), len(ids)]
        row = {
            "step": trainer.global_step,
            "rank": trainer.global_rank,
            "shape": list(batch["input_ids"].shape),
            "samples": [_digest(ids[a:b]) for a, b in itertools.pairwise(bounds)],
        }
        with open(self.path, "a") as fh:
            fh.write(json.dumps(row) + "\n")
