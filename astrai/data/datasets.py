"""Map-style datasets over storages, and the collate functions that batch them.

Every training sample is already shifted: ``labels[t]`` is the token that should follow
``input_ids[t]`` (``IGNORE_INDEX`` where no loss is taken), so a strategy computes
``cross_entropy(logits.flatten(0, 1), labels.flatten())`` without shifting again.

Batches are dicts of ``[B, S]`` tensors:

- pretrain / sft: ``input_ids``, ``labels``, ``attention_mask`` (1 = real token),
  ``position_ids`` (restart at 0 for every packed document), sft also ``loss_mask``; a batch
  of packed documents (positions restarting inside a row) also ``cu_seqlens``, int32
  ``[documents + 1]``: where each document starts in the flattened ``B * S`` tokens (a row's
  padding tail one more document), then ``B * S`` (flash-attn's varlen layout); sft
  prepared with a teacher also ``teacher_topk_ids`` (int64) and ``teacher_topk_logprobs``
  (float32) ``[B, S, k]``, entry ``[i, j]`` the teacher's top-k for ``labels[i, j]`` (padding:
  ids 0, log-probs 0; the labels say which positions count).
- preference: the same keys prefixed with ``chosen_`` and ``rejected_``, both padded to one
  length so that a strategy may concatenate them into one ``[2B, S]`` forward.
- prompt (GRPO): ``input_ids`` and ``attention_mask`` *left*-padded for generation, plus
  ``prompt_ids`` (list of lists, unpadded) and ``records`` (the raw records, for rewards).
- unpaired (KTO): row i is prompt i + completion i under the sft keys (``loss_mask`` on the
  completion), the same keys prefixed ``kl_`` hold prompt i + the completion of row i - 1
  (row 0 takes the last row's: KTO's mismatched pairs), both padded to one length, and
  ``label`` ``[B]`` bool (True = desirable).

Each dataset exposes ``collate`` (picklable, for DataLoader workers).
"""

from __future__ import annotations

import functools
import json
from collections.abc import Sequence
from typing import Any, ClassVar

import numpy as np
import torch
from torch.utils.data import Dataset

from astrai.data.encode import UNPAIRED_KEYS
from astrai.data.storage import DataError, Storage, open_storage
from astrai.data.teacher_topk import TOP_K_ATTR, TOPK_IDS, TOPK_LOGPROBS

IGNORE_INDEX = -100


class _StorageDataset(Dataset):
    """Opens the storage lazily per process and checks keys and tokenizer fingerprint.

    ``kind`` is the ``astrai.data.prepare`` kind that writes the keys a dataset reads; the
    datamodule prepares a spec's ``prepare:`` block with it.
    """

    kind: ClassVar[str | None] = None
    required_keys: tuple[str, ...] = ()

    def __init__(
        self,
        source: Any,
        *,
        tokenizer_fingerprint: Any = None,
        pad_id: int | None = None,
        skip_bad_lines: bool = False,
    ) -> None:
        kwargs: dict[str, Any] = {
            "keys": self.required_keys,
            "tokenizer_fingerprint": tokenizer_fingerprint,
        }
        if isinstance(source, str) and source.endswith((".json", ".jsonl")):
            kwargs["skip_bad_lines"] = skip_bad_lines
        self.storage: Storage = open_storage(source, **kwargs)
        if len(self.storage) == 0:
            raise DataError(f"{self.storage.path}: storage holds no documents")
        if pad_id is None:  # the tokenizer's pad id, recorded by prepare
            attrs = getattr(self.storage, "attrs", {})
            pad_id = int(attrs.get("pad_token_id", -1))
            pad_id = pad_id if pad_id >= 0 else 0
        self.pad_id = pad_id

    def __len__(self) -> int:
        return len(self.storage)

    def _doc(self, key: str, index: int) -> np.ndarray:
        return self.storage.get(key, index)


# ------------------------------------------------------------------------------------ pretrain


class PretrainDataset(_StorageDataset):
    """Windows over the concatenated token stream: sample i covers tokens
    ``[i * stride, i * stride + window_size + 1)``; inputs are the first ``window_size``
    tokens, labels the last ``window_size``.

    The tail that does not fill a whole window is not used (as in litgpt / nanoGPT); with
    ``stride < window_size`` windows overlap. ``reset_position_ids`` restarts positions at
    every document start, for models trained on packed documents.
    """

    kind = "pretrain"

    def __init__(
        self,
        source: Any,
        window_size: int,
        stride: int | None = None,
        *,
        key: str = "input_ids",
        reset_position_ids: bool = False,
        tokenizer_fingerprint: Any = None,
        pad_id: int | None = None,
    ) -> None:
        self.required_keys = (key,)
        super().__init__(source, tokenizer_fingerprint=tokenizer_fingerprint, pad_id=pad_id)
        if window_size < 1:
            raise ValueError(f"PretrainDataset: window_size must be >= 1, got {window_size}")
        self.key = key
        self.window_size = window_size
        self.stride = window_size if stride is None else stride
        if self.stride < 1:
            raise ValueError(f"PretrainDataset: stride must be >= 1, got {self.stride}")
        self.reset_position_ids = reset_position_ids
        self.total_tokens = self.storage.num_tokens(key)
        if self.total_tokens < window_size + 1:
            raise DataError(
                f"{self.storage.path}: window_size={window_size} needs {window_size + 1} tokens "
                f"(inputs plus the shifted target) but the corpus has {self.total_tokens}; "
                f"use a smaller window_size or more data"
            )
        self._len = (self.total_tokens - window_size - 1) // self.stride + 1
        self.collate = functools.partial(collate_lm, pad_id=self.pad_id)

    def __len__(self) -> int:
        return self._len

    def token_lengths(self) -> np.ndarray:
        """Tokens of each sample as the model sees it: ``window_size`` for every window."""
        return np.full(self._len, self.window_size, dtype=np.int64)

    def window_start(self, index: int) -> int:
        if index < 0:
            index += self._len
        if not 0 <= index < self._len:
            raise IndexError(f"window {index} out of range ({self._len} windows)")
        return index * self.stride

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        start = self.window_start(index)
        tokens = torch.from_numpy(self.storage.slice(self.key, start, start + self.window_size + 1))
        item = {"input_ids": tokens[:-1], "labels": tokens[1:]}
        if self.reset_position_ids:
            offsets = self.storage.offsets(self.key)
            pos = np.arange(start, start + self.window_size)
            doc_start = offsets[np.searchsorted(offsets, pos, side="right") - 1]
            item["position_ids"] = torch.from_numpy(pos - np.maximum(doc_start, start))
        return item


# ----------------------------------------------------------------------------------------- sft


def _shifted(
    ids: np.ndarray, mask: np.ndarray, pos: np.ndarray | None, prefix: str = ""
) -> dict[str, torch.Tensor]:
    ids_t = torch.from_numpy(ids)
    mask_t = torch.from_numpy(mask.astype(np.bool_))
    labels = ids_t[1:].masked_fill(~mask_t[1:], IGNORE_INDEX)
    position = torch.from_numpy(pos[:-1]) if pos is not None else torch.arange(len(ids) - 1)
    return {
        f"{prefix}input_ids": ids_t[:-1],
        f"{prefix}labels": labels,
        f"{prefix}loss_mask": mask_t[1:],
        f"{prefix}position_ids": position,
    }


class SFTDataset(_StorageDataset):
    """Chat documents with a loss mask on assistant tokens (``input_ids``, ``loss_mask``, and
    ``position_ids`` when prepared with packing). ``max_length`` truncates at load time.
    A storage prepared with a teacher also gives each sample the teacher's top-k
    (``teacher_topk_ids`` / ``teacher_topk_logprobs`` ``[len(labels), k]``)."""

    kind = "sft"
    required_keys = ("input_ids", "loss_mask")

    def __init__(
        self,
        source: Any,
        *,
        max_length: int | None = None,
        tokenizer_fingerprint: Any = None,
        pad_id: int | None = None,
    ) -> None:
        super().__init__(source, tokenizer_fingerprint=tokenizer_fingerprint, pad_id=pad_id)
        self.max_length = max_length
        self.has_positions = "position_ids" in self.storage.keys
        self.teacher_top_k = int(self.storage.attrs.get(TOP_K_ATTR, 0)) if self.has_teacher else 0
        self.collate = functools.partial(collate_lm, pad_id=self.pad_id)

    @property
    def has_teacher(self) -> bool:
        """Whether the storage holds a teacher's top-k (``prepare ... teacher=``)."""
        return TOPK_IDS in self.storage.keys

    def token_lengths(self) -> np.ndarray:
        """Tokens of each sample as the model sees it (after ``max_length`` and the shift),
        from the storage's document offsets: no document is read."""
        stored = np.diff(self.storage.offsets("input_ids"))
        if self.max_length is not None:
            stored = np.minimum(stored, self.max_length + 1)
        return np.maximum(stored - 1, 0).astype(np.int64)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        ids = self._doc("input_ids", index)
        mask = self._doc("loss_mask", index)
        pos = self._doc("position_ids", index) if self.has_positions else None
        if self.max_length is not None:
            end = self.max_length + 1
            ids, mask = ids[:end], mask[:end]
            pos = pos[:end] if pos is not None else None
        if len(ids) < 2:
            raise DataError(f"{self.storage.path}: document {index} has fewer than 2 tokens")
        item = _shifted(ids, mask, pos)
        if self.has_teacher:
            item.update(self._teacher(index, len(ids) - 1))
        return item

    def _teacher(self, index: int, targets: int) -> dict[str, torch.Tensor]:
        """The stored top-k of the first ``targets`` target positions of a document."""
        k = self.teacher_top_k
        ids = self._doc(TOPK_IDS, index).reshape(-1, k)[:targets]
        logprobs = self._doc(TOPK_LOGPROBS, index).reshape(-1, k)[:targets]
        if len(ids) != targets:
            raise DataError(
                f"{self.storage.path}: document {index} has {len(ids)} teacher top-k rows for "
                f"{targets} targets; prepare it again"
            )
        return {TOPK_IDS: torch.from_numpy(ids), TOPK_LOGPROBS: torch.from_numpy(logprobs)}


# ---------------------------------------------------------------------------------- preference


class PreferenceDataset(_StorageDataset):
    """Pairs of the same prompt with a chosen and a rejected answer, each with its loss mask."""

    kind = "preference"
    required_keys = ("chosen_ids", "chosen_mask", "rejected_ids", "rejected_mask")

    def __init__(
        self,
        source: Any,
        *,
        max_length: int | None = None,
        tokenizer_fingerprint: Any = None,
        pad_id: int | None = None,
    ) -> None:
        super().__init__(source, tokenizer_fingerprint=tokenizer_fingerprint, pad_id=pad_id)
        self.max_length = max_length
        self.collate = functools.partial(collate_preference, pad_id=self.pad_id)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        item: dict[str, torch.Tensor] = {}
        for side in ("chosen", "rejected"):
            ids = self._doc(f"{side}_ids", index)
            mask = self._doc(f"{side}_mask", index)
            if self.max_length is not None:
                ids, mask = ids[: self.max_length + 1], mask[: self.max_length + 1]
            item.update(_shifted(ids, mask, None, prefix=f"{side}_"))
        return item


# ------------------------------------------------------------------------------------ unpaired


class UnpairedDataset(_StorageDataset):
    """Thumbs-up/down data for KTO: a prompt, one completion and whether it is desirable.

    The prompt and the completion are kept apart (``prompt_ids``, ``completion_ids``,
    ``completion_mask`` and ``label``); :func:`collate_unpaired` joins them, and joins each
    prompt with another row's completion for KTO's KL estimate. ``max_length`` cuts both
    rows at load time (the completion's end goes first).
    """

    kind = "unpaired"
    required_keys = UNPAIRED_KEYS

    def __init__(
        self,
        source: Any,
        *,
        max_length: int | None = None,
        tokenizer_fingerprint: Any = None,
        pad_id: int | None = None,
    ) -> None:
        super().__init__(source, tokenizer_fingerprint=tokenizer_fingerprint, pad_id=pad_id)
        self.max_length = max_length
        self.collate = functools.partial(
            collate_unpaired, pad_id=self.pad_id, max_length=max_length
        )

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {
            "prompt_ids": torch.from_numpy(self._doc("prompt_ids", index).astype(np.int64)),
            "completion_ids": torch.from_numpy(self._doc("completion_ids", index).astype(np.int64)),
            "completion_mask": torch.from_numpy(
                self._doc("completion_mask", index).astype(np.bool_)
            ),
            "label": torch.tensor(bool(self._doc("label", index)[0])),
        }

    def label_counts(self) -> tuple[int, int]:
        """``(desirable, undesirable)`` over the whole dataset (KTO weighs its losses by them)."""
        labels = np.asarray(self.storage.slice("label", 0, self.storage.num_tokens("label")))
        desirable = int(labels.astype(bool).sum())
        return desirable, len(labels) - desirable


# -------------------------------------------------------------------------------------- prompt


class PromptDataset(_StorageDataset):
    """GRPO prompts: rendered prompt ids (generation prompt included) plus the raw record, whose
    fields (e.g. ``answer``) the reward functions read."""

    kind = "prompt"
    required_keys = ("prompt_ids", "records")

    def __init__(
        self, source: Any, *, tokenizer_fingerprint: Any = None, pad_id: int | None = None
    ) -> None:
        super().__init__(source, tokenizer_fingerprint=tokenizer_fingerprint, pad_id=pad_id)
        self.collate = functools.partial(collate_prompt, pad_id=self.pad_id)

    def __getitem__(self, index: int) -> dict[str, Any]:
        record = self.storage.get("records", index)
        if isinstance(record, str):
            record = json.loads(record)
        return {"prompt_ids": torch.from_numpy(self._doc("prompt_ids", index)), "record": record}


# ------------------------------------------------------------------------------------- collate


def _pad_right(
    seqs: Sequence[torch.Tensor], length: int, value: int, dtype: torch.dtype | None = None
) -> torch.Tensor:
    dtype = dtype or seqs[0].dtype
    out = torch.full((len(seqs), length), value, dtype=dtype)
    for i, s in enumerate(seqs):
        out[i, : len(s)] = s
    return out


def _target_length(lengths: Sequence[int], pad_to_multiple_of: int | None) -> int:
    n = max(lengths)
    if pad_to_multiple_of:
        n = -(-n // pad_to_multiple_of) * pad_to_multiple_of
    return n


def collate_lm(
    batch: Sequence[dict[str, torch.Tensor]],
    *,
    pad_id: int = 0,
    pad_to_multiple_of: int | None = None,
    prefix: str = "",
    length: int | None = None,
) -> dict[str, torch.Tensor]:
    """Right-pad ``input_ids`` (``pad_id``), ``labels`` (``IGNORE_INDEX``), ``loss_mask``
    (False), ``position_ids`` (continuing, so padded rows stay monotone) and a teacher's
    top-k ``[B, S, k]`` (0); add ``attention_mask``."""
    ids = [b[f"{prefix}input_ids"] for b in batch]
    n = length or _target_length([len(s) for s in ids], pad_to_multiple_of)
    out = {
        f"{prefix}input_ids": _pad_right(ids, n, pad_id, torch.long),
        f"{prefix}labels": _pad_right([b[f"{prefix}labels"] for b in batch], n, IGNORE_INDEX),
        f"{prefix}attention_mask": _pad_right(
            [torch.ones(len(s), dtype=torch.long) for s in ids], n, 0
        ),
    }
    out[f"{prefix}labels"] = out[f"{prefix}labels"].long()
    if f"{prefix}loss_mask" in batch[0]:
        out[f"{prefix}loss_mask"] = _pad_right([b[f"{prefix}loss_mask"] for b in batch], n, 0)
    for key, dtype in ((TOPK_IDS, torch.long), (TOPK_LOGPROBS, torch.float32)):
        if f"{prefix}{key}" in batch[0]:
            rows = [b[f"{prefix}{key}"] for b in batch]
            padded = torch.zeros((len(rows), n, rows[0].shape[-1]), dtype=dtype)
            for i, r in enumerate(rows):
                padded[i, : len(r)] = r
            out[f"{prefix}{key}"] = padded
    if f"{prefix}position_ids" in batch[0]:
        pos = torch.arange(n).repeat(len(batch), 1)
        for i, b in enumerate(batch):
            p = b[f"{prefix}position_ids"].long()
            pos[i, : len(p)] = p
            if len(p) < n:
                last = int(p[-1]) if len(p) else -1
                pos[i, len(p) :] = torch.arange(last + 1, last + 1 + n - len(p))
        out[f"{prefix}position_ids"] = pos
        real = out[f"{prefix}attention_mask"].bool()
        if bool(((pos[:, 1:] != pos[:, :-1] + 1) & real[:, 1:]).any()):  # packed documents
            out[f"{prefix}cu_seqlens"] = cu_seqlens_of(pos, real)
    else:
        out[f"{prefix}position_ids"] = torch.arange(n).repeat(len(batch), 1)
    return out


def cu_seqlens_of(position_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """The documents of a right-padded ``[B, S]`` batch as flash-attn's ``cu_seqlens`` (int32):
    a document starts at each row's start, where a position id is not its predecessor plus
    one, and where a row's padding tail begins; then ``B * S`` closes the last."""
    real = attention_mask.bool()
    starts = torch.zeros_like(real)
    starts[:, 0] = True
    starts[:, 1:] = (position_ids[:, 1:] != position_ids[:, :-1] + 1) | (
        real[:, :-1] & ~real[:, 1:]
    )
    cuts = starts.flatten().nonzero()[:, 0]
    return torch.cat([cuts, cuts.new_tensor([real.numel()])]).to(torch.int32)


def collate_preference(
    batch: Sequence[dict[str, torch.Tensor]],
    *,
    pad_id: int = 0,
    pad_to_multiple_of: int | None = None,
) -> dict[str, torch.Tensor]:
    """Pad chosen and rejected to one common length (one ``[2B, S]`` forward is possible)."""
    lengths = [len(b[f"{side}_input_ids"]) for b in batch for side in ("chosen", "rejected")]
    n = _target_length(lengths, pad_to_multiple_of)
    out: dict[str, torch.Tensor] = {}
    for side in ("chosen", "rejected"):
        out.update(collate_lm(batch, pad_id=pad_id, prefix=f"{side}_", length=n))
    return out


def _unpaired_row(
    prompt: torch.Tensor, completion: torch.Tensor, mask: torch.Tensor, max_length: int | None
) -> tuple[np.ndarray, np.ndarray]:
    ids = torch.cat([prompt, completion]).numpy()
    loss = np.concatenate([np.zeros(len(prompt), dtype=np.bool_), mask.numpy().astype(np.bool_)])
    if max_length is not None:
        ids, loss = ids[: max_length + 1], loss[: max_length + 1]
    return ids, loss


def collate_unpaired(
    batch: Sequence[dict[str, torch.Tensor]],
    *,
    pad_id: int = 0,
    pad_to_multiple_of: int | None = None,
    max_length: int | None = None,
) -> dict[str, torch.Tensor]:
    """Rows of prompt i + completion i, and ``kl_`` rows of prompt i + completion i - 1.

    The KL partner is TRL's: completions rotated by one within the batch,
    ``(x_1, y_n), (x_2, y_1), ..., (x_n, y_{n-1})``, so the mismatched completions are the
    batch's own (with one row, its own completion). Both sets are right-padded to one length
    so a strategy may run them as one ``[2B, S]`` forward.
    """
    rows, kl_rows = [], []
    n = len(batch)
    for i, item in enumerate(batch):
        partner = batch[(i - 1) % n]
        for out, donor in ((rows, item), (kl_rows, partner)):
            ids, loss = _unpaired_row(
                item["prompt_ids"], donor["completion_ids"], donor["completion_mask"], max_length
            )
            if len(ids) < 2:
                raise DataError(f"unpaired row {i}: fewer than 2 tokens after max_length")
            out.append(_shifted(ids, loss, None, prefix="" if out is rows else "kl_"))
    lengths = [len(r["input_ids"]) for r in rows] + [len(r["kl_input_ids"]) for r in kl_rows]
    length = _target_length(lengths, pad_to_multiple_of)
    out = collate_lm(rows, pad_id=pad_id, length=length)
    out.update(collate_lm(kl_rows, pad_id=pad_id, prefix="kl_", length=length))
    out["label"] = torch.stack([torch.as_tensor(item["label"], dtype=torch.bool) for item in batch])
    return out


def collate_prompt(batch: Sequence[dict[str, Any]], *, pad_id: int = 0) -> dict[str, Any]:
    """Left-pad prompts for batched generation; keep unpadded ids and the records."""
    prompts = [b["prompt_ids"].long() for b in batch]
    n = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), n), pad_id, dtype=torch.long)
    attn = torch.zeros((len(prompts), n), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, n - len(p) :] = p
        attn[i, n - len(p) :] = 1
    return {
        "input_ids": ids,
        "attention_mask": attn,
        "prompt_ids": [p.tolist() for p in prompts],
        "records": [b["record"] for b in batch],
    }
