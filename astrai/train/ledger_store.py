"""The step ledger's file: one H5 file of appendable columns, written a step at a time.

Layout (`ledger.h5`; attributes on the root say what run wrote it):
- ``steps/<column>``: one row per optimizer step (``step``, ``loss``, ``grad_norm``, ``lr``,
  ``weights_digest``, ``rng_digest``, ``batch_digest``, ``epoch``, ``sample_start``,
  ``sample_end``, ``micro_batches``); ragged per-step values (each micro-batch's loss, the
  sample ids) as a flat column plus the per-step count.
- ``rollouts/<column>``: one row per GRPO generation batch (``seed``, ``step`` it was sampled
  at, ``version``, ``count``), its completions' tokens, behaviour log-probs and rewards as flat
  columns with per-completion lengths.

Every append is flushed, so a killed run keeps every step it finished; a resumed run first
cuts the rows after its checkpoint (`truncate`), then appends.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import h5py
import numpy as np

__all__ = ["LEDGER_VERSION", "LedgerFile", "RolloutRecord", "StepRecord"]

LEDGER_VERSION = 1

#: per-step scalar columns and their dtypes
STEP_COLUMNS: dict[str, Any] = {
    "step": np.int64,
    "loss": np.float64,
    "grad_norm": np.float64,
    "lr": np.float64,
    "weights_digest": "S32",
    "rng_digest": "S32",
    "batch_digest": "S32",
    "epoch": np.int64,
    "sample_start": np.int64,
    "sample_end": np.int64,
    "micro_batches": np.int64,
    "sample_count": np.int64,
}
#: per-step ragged columns: (flat column, the per-step count column)
STEP_RAGGED = {
    "micro_loss": ("micro_batches", np.float64),
    "sample_ids": ("sample_count", np.int64),
    # each sample's source: its index in data.train.sources (0 for a split of one source)
    "sample_sources": ("sample_count", np.int64),
}

ROLLOUT_COLUMNS: dict[str, Any] = {
    "seed": np.int64,
    "step": np.int64,
    "version": np.int64,
    "count": np.int64,
    "extra": h5py.string_dtype(),
}
#: per-completion columns of a rollout row (``count`` entries each)
COMPLETION_COLUMNS: dict[str, Any] = {
    "prompt_len": np.int64,
    "completion_len": np.int64,
    "mask_len": np.int64,
    "truncated": np.bool_,
    "reward": np.float64,
}
#: per-token flat columns and the per-completion length column that counts them
TOKEN_COLUMNS = {
    "prompt_tokens": ("prompt_len", np.int64),
    "completion_tokens": ("completion_len", np.int64),
    "logprobs": ("completion_len", np.float64),
    "action_masks": ("mask_len", np.int8),
}


class StepRecord(dict):
    """One optimizer step's row: the `STEP_COLUMNS` plus ``micro_loss`` and ``sample_ids``."""


class RolloutRecord(dict):
    """One generation batch: ``seed``, ``step``, ``version``, and per completion ``prompts``,
    ``completions``, ``logprobs``, ``truncated``, ``rewards``, ``action_masks`` (or None),
    plus ``parts`` and ``stats`` (the reward parts' and episodes' means)."""


def _column(group: h5py.Group, name: str, dtype: Any) -> h5py.Dataset:
    if name not in group:
        group.create_dataset(name, shape=(0,), maxshape=(None,), dtype=dtype, chunks=True)
    return group[name]


def _append(group: h5py.Group, name: str, dtype: Any, values: Any) -> None:
    data = np.asarray(values, dtype=dtype if dtype != h5py.string_dtype() else object)
    column = _column(group, name, dtype)
    start = column.shape[0]
    column.resize((start + len(data),))
    if len(data):
        column[start:] = data


def _cut(group: h5py.Group, name: str, size: int) -> None:
    if name in group:
        group[name].resize((size,))


class LedgerFile:
    """Reading and appending `ledger.h5`; one writer (rank 0) at a time."""

    def __init__(self, path: str | Path, mode: str = "r") -> None:
        self.path = Path(path)
        if mode == "r" and not self.path.is_file():
            raise FileNotFoundError(f"{self.path}: no step ledger here (train with ledger=true)")
        try:
            self.h5 = h5py.File(self.path, mode)
        except OSError as err:
            raise ValueError(f"{self.path}: not a readable ledger ({err})") from None
        if mode != "r":
            self.h5.require_group("steps")
            self.h5.require_group("rollouts")

    # ------------------------------------------------------------------ metadata
    @property
    def meta(self) -> dict[str, Any]:
        """The run's attributes (JSON-decoded where they were stored as JSON)."""
        out = {}
        for key, value in self.h5.attrs.items():
            if isinstance(value, bytes):
                value = value.decode()
            if isinstance(value, str) and key.endswith("_json"):
                out[key[: -len("_json")]] = json.loads(value)
            elif isinstance(value, np.generic):
                out[key] = value.item()
            else:
                out[key] = value
        return out

    def set_meta(self, **values: Any) -> None:
        for key, value in values.items():
            if isinstance(value, (dict, list)) or value is None:
                self.h5.attrs[f"{key}_json"] = json.dumps(value, default=str)
            else:
                self.h5.attrs[key] = value
        self.h5.flush()

    # ------------------------------------------------------------------ steps
    @property
    def steps(self) -> list[int]:
        group = self.h5.get("steps")
        if group is None or "step" not in group:
            return []
        return [int(s) for s in group["step"][:]]

    def append_step(self, record: Mapping[str, Any]) -> None:
        group = self.h5["steps"]
        record = dict(record)
        record["micro_batches"] = len(record["micro_loss"])
        record["sample_count"] = len(record["sample_ids"])
        record.setdefault("sample_sources", [0] * record["sample_count"])
        for name, dtype in STEP_COLUMNS.items():
            _append(group, name, dtype, [record[name]])
        for name, (_, dtype) in STEP_RAGGED.items():
            _append(group, name, dtype, record[name])
        self.h5.flush()

    def step(self, step: int) -> StepRecord:
        """The row of optimizer step ``step`` (the K-th optimizer step of the run)."""
        group = self.h5["steps"]
        rows = np.flatnonzero(group["step"][:] == step) if "step" in group else []
        if len(rows) == 0:
            have = self.steps
            span = f"{have[0]}..{have[-1]}" if have else "none"
            raise KeyError(f"{self.path}: step {step} is not in the ledger (steps {span})")
        row = int(rows[-1])
        out = StepRecord()
        for name in STEP_COLUMNS:
            value = group[name][row]
            out[name] = value.decode() if isinstance(value, bytes) else value.item()
        for name, (count, _) in STEP_RAGGED.items():
            if name not in group:  # a column added since the ledger was written
                continue
            counts = group[count][:]
            start = int(counts[:row].sum())
            out[name] = group[name][start : start + int(counts[row])].tolist()
        return out

    # ------------------------------------------------------------------ rollouts
    def append_rollout(self, record: Mapping[str, Any]) -> None:
        group = self.h5["rollouts"]
        prompts, completions = record["prompts"], record["completions"]
        masks = record.get("action_masks")
        count = len(completions)
        extra = {
            "parts": record.get("parts", {}),
            "stats": record.get("stats", {}),
            "reward_columns": record.get("reward_columns", {}),
        }
        extra["has_masks"] = masks is not None
        row = {**record, "count": count, "extra": json.dumps(extra)}
        for name, dtype in ROLLOUT_COLUMNS.items():
            _append(group, name, dtype, [row[name]])
        per = {
            "prompt_len": [len(p) for p in prompts],
            "completion_len": [len(c) for c in completions],
            "mask_len": [len(m) for m in masks] if masks is not None else [0] * count,
            "truncated": record["truncated"],
            "reward": record["rewards"],
        }
        for name, dtype in COMPLETION_COLUMNS.items():
            _append(group, name, dtype, per[name])
        flat = {
            "prompt_tokens": prompts,
            "completion_tokens": completions,
            "logprobs": record["logprobs"],
            "action_masks": masks or [],
        }
        for name, (_, dtype) in TOKEN_COLUMNS.items():
            values = [v for seq in flat[name] for v in seq]
            _append(group, name, dtype, values)
        self.h5.flush()

    def rollout_index(self) -> list[tuple[int, int]]:
        """``(seed, step it was sampled at)`` of every generation batch, in recorded order."""
        group = self.h5.get("rollouts")
        if group is None or "seed" not in group:
            return []
        return [(int(a), int(b)) for a, b in zip(group["seed"][:], group["step"][:], strict=True)]

    def rollout(self, seed: int) -> RolloutRecord:
        """The generation batch sampled with ``seed`` (the newest, after a resume)."""
        group = self.h5["rollouts"]
        seeds = group["seed"][:] if "seed" in group else np.zeros(0)
        rows = np.flatnonzero(seeds == seed)
        if len(rows) == 0:
            raise KeyError(f"{self.path}: no rollouts with seed {seed} in the ledger")
        row = int(rows[-1])
        counts = group["count"][:]
        first = int(counts[:row].sum())
        n = int(counts[row])
        per = {name: group[name][first : first + n] for name in COMPLETION_COLUMNS}
        out = RolloutRecord(
            seed=int(seed), step=int(group["step"][row]), version=int(group["version"][row])
        )
        for name, (length, _) in TOKEN_COLUMNS.items():
            lengths = group[length][:]
            start = int(lengths[:first].sum())
            seqs = []
            for size in per[length]:
                seqs.append(group[name][start : start + int(size)].tolist())
                start += int(size)
            out[name] = seqs
        extra = json.loads(group["extra"][row])
        out["prompts"] = out.pop("prompt_tokens")
        out["completions"] = out.pop("completion_tokens")
        out["action_masks"] = out["action_masks"] if extra["has_masks"] else None
        out["truncated"] = [bool(t) for t in per["truncated"]]
        out["rewards"] = [float(r) for r in per["reward"]]
        out["parts"], out["stats"] = extra["parts"], extra["stats"]
        out["reward_columns"] = extra.get("reward_columns", {})  # older ledgers: none
        return out

    # ------------------------------------------------------------------ resume
    def truncate(self, step: int) -> None:
        """Forget the steps after ``step`` and the rollouts sampled at or after it: a run
        resumed from step ``step``'s checkpoint records them again."""
        steps = self.h5["steps"]
        if "step" in steps:
            keep = int(np.sum(steps["step"][:] <= step))
            micro = int(steps["micro_batches"][:keep].sum())
            ids = int(steps["sample_count"][:keep].sum())
            for name in STEP_COLUMNS:
                _cut(steps, name, keep)
            _cut(steps, "micro_loss", micro)
            _cut(steps, "sample_ids", ids)
            _cut(steps, "sample_sources", ids)
        rollouts = self.h5["rollouts"]
        if "step" in rollouts:
            keep = int(np.sum(rollouts["step"][:] < step))
            completions = int(rollouts["count"][:keep].sum())
            for name in ROLLOUT_COLUMNS:
                _cut(rollouts, name, keep)
            for name in COMPLETION_COLUMNS:
                _cut(rollouts, name, completions)
            for name, (length, _) in TOKEN_COLUMNS.items():
                _cut(rollouts, name, int(rollouts[length][:completions].sum()))
        self.h5.flush()

    def close(self) -> None:
        self.h5.close()

    def __enter__(self) -> LedgerFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
