"""Padding-free language-model batches (TRL's ``padding_free``; transformers'
``DataCollatorWithFlattening``): the real tokens of a batch's samples in one row.

``collate_lm`` right-pads a batch to its longest sample, and the padding is computed like any
token; with packed SFT windows or long-tailed chat lengths it can be most of the batch.
:class:`PaddingFree` collates as usual, then keeps only the real tokens, concatenated into one
``[1, T]`` row. Each sample keeps its own position ids (restarting at 0 for every packed
document, and at the start of every sample), so the model attends within each document only
(``astrai.model.documents``: per document span, no ``[S, S]`` mask) and nothing is padded:
the loss (a mean over the labelled tokens) and its gradients are the padded batch's.
``AstraiDataModule(padding_free=True)`` (``data.padding_free``) uses it for pretrain and SFT
datasets.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from astrai.data.datasets import cu_seqlens_of

#: the keys of a pretrain / SFT batch (``collate_lm``), all ``[B, S]``
LM_KEYS = ("input_ids", "labels", "attention_mask", "loss_mask", "position_ids")


class PaddingFree:
    """A collate function: ``collate``'s padded language-model batch, flattened into one row
    (:func:`flatten_lm`). Picklable, for DataLoader workers."""

    def __init__(self, collate: Callable[[Sequence[Any]], dict[str, torch.Tensor]]) -> None:
        self.collate = collate

    def __call__(self, samples: Sequence[Any]) -> dict[str, torch.Tensor]:
        return flatten_lm(self.collate(samples))


def flatten_lm(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A right-padded ``[B, S]`` pretrain / SFT batch as one ``[1, T]`` row of its real tokens
    (``attention_mask`` 1), every key kept; ``attention_mask`` becomes all ones and
    ``cu_seqlens`` (packed documents' boundaries), when the batch has them, the row's."""
    packed = "cu_seqlens" in batch
    batch = {k: v for k, v in batch.items() if k != "cu_seqlens"}
    other = sorted(set(batch) - set(LM_KEYS))
    if other or "attention_mask" not in batch or "position_ids" not in batch:
        raise ValueError(
            f"data.padding_free flattens pretrain and SFT batches ({', '.join(LM_KEYS)}); this "
            f"batch has keys {sorted(batch)}"
        )
    keep = batch["attention_mask"].bool()
    positions = batch["position_ids"]
    lengths = keep.sum(-1)
    first = positions[:, 0]
    last = positions.gather(1, (lengths - 1).clamp(min=0)[:, None])[:, 0]
    joined = (first[1:] == last[:-1] + 1) & (lengths[1:] > 0) & (lengths[:-1] > 0)
    if bool(joined.any()):
        row = int(joined.nonzero()[0, 0]) + 1
        raise ValueError(
            f"data.padding_free: sample {row} of the batch starts at position {int(first[row])}, "
            "right after the previous sample's last position, so packed into one row the two "
            "would read as one document (a pretrain window with reset_position_ids starting "
            "mid-document?); set data.padding_free=false for this data"
        )
    out = {key: value[keep][None] for key, value in batch.items()}
    out["attention_mask"] = torch.ones_like(out["attention_mask"])
    if packed:
        out["cu_seqlens"] = cu_seqlens_of(out["position_ids"], out["attention_mask"])
    return out
