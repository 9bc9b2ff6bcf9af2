"""The sequences one distillation micro-batch trains on: the dataset's own (off-policy) or the
student's completions of the dataset's prompts (on-policy), as right-padded rows
``input_ids [N, S]`` with the trained positions ``mask [N, S - 1]`` (position ``j`` predicts
``input_ids[:, j + 1]``: the grid of :class:`~astrai.train.strategies.distill.teacher.
TeacherScores`)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from astrai.data.datasets import IGNORE_INDEX
from astrai.train.strategies.grpo.sampling import Samples

__all__ = ["Sequences", "dataset_sequences", "prompts_of", "student_sequences"]


@dataclass
class Sequences:
    """Right-padded rows and the positions trained on (``mask``, bool)."""

    input_ids: Tensor
    mask: Tensor

    @property
    def completion_lengths(self) -> Tensor:
        return self.mask.sum(-1).float()


def check_unpacked(batch: Mapping[str, Any]) -> None:
    """Distillation reads one document per row (its prompt, its completion): a packed batch
    (position ids that restart inside a row) is refused."""
    pos = batch.get("position_ids")
    if pos is None:
        return
    expected = torch.arange(pos.shape[1], device=pos.device).expand_as(pos)
    if not torch.equal(pos, expected):
        raise ValueError(
            "strategy=distill: the batch is packed (position ids restart inside a row: data "
            "prepared with pack=true, or data.padding_free=true); distillation needs one "
            "document per row: prepare the data with pack=false and data.padding_free=false"
        )


def dataset_sequences(batch: Mapping[str, Any], pad_id: int) -> Sequences:
    """The dataset's documents: the loader's ``input_ids`` ``[N, S]`` (a document's tokens but
    its last) with the last labelled token appended, ``[N, S + 1]``; trained where the labels
    are set (the assistant's tokens)."""
    check_unpacked(batch)
    ids, labels = batch["input_ids"], batch["labels"]
    full = torch.cat([ids, ids.new_full((ids.shape[0], 1), pad_id)], dim=1)
    mask = labels != IGNORE_INDEX
    full[:, 1:] = torch.where(mask, labels, full[:, 1:])
    return Sequences(full, mask)


def prompts_of(batch: Mapping[str, Any]) -> list[list[int]]:
    """Each document's prompt: its tokens up to and including the one that predicts the first
    labelled token (a row without labels: its whole length)."""
    check_unpacked(batch)
    ids, labels = batch["input_ids"], batch["labels"]
    lengths = batch["attention_mask"].sum(-1).tolist() if "attention_mask" in batch else None
    prompts = []
    for i in range(ids.shape[0]):
        labelled = (labels[i] != IGNORE_INDEX).nonzero()
        end = (
            int(labelled[0, 0]) + 1
            if len(labelled)
            else int(lengths[i] if lengths else ids.shape[1])
        )
        prompts.append(ids[i, :end].tolist())
    return prompts


def student_sequences(samples: Samples, pad_id: int, device: torch.device) -> Sequences:
    """Each prompt followed by the student's completion, right-padded; trained on the
    completion's tokens."""
    rows = [list(p) + list(c) for p, c in zip(samples.prompts, samples.completions)]
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width - 1), dtype=torch.bool)
    for i, (row, prompt) in enumerate(zip(rows, samples.prompts)):
        ids[i, : len(row)] = torch.tensor(row, dtype=torch.long)
        mask[i, len(prompt) - 1 : len(row) - 1] = True
    return Sequences(ids.to(device), mask.to(device))
