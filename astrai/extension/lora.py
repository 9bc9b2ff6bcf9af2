"""Many LoRA adapters over one base in one batch: the per-token low-rank delta.

The engine keeps the adapters it serves in slots (`astrai.inference.adapters`): for each
adapted projection one stack of A matrices `[slots * rank, in]` and one of B transposed
`[slots * rank, out]`, ranks zero-padded to the engine's `max_lora_rank`, so a lower-rank
adapter adds exact zeros. Each token of a step names its slot (`LoRABatch.token_slots`,
-1 for the base model) and `lora_delta` adds `scaling * (x A^T) B^T` of that slot to the
base projection's output, in place: one call per projection whatever the mix of adapters.

Two implementations behind this one entry point (S-LoRA / Punica's gathered product):
- plain torch (the CPU, and any device without Triton): the token's slot as a mask over
  the stacked columns. `h = x A[:w]^T` is one product over the columns of the slots in
  use (`width`), `h * mask` keeps each token's own slot's columns times its scaling, and
  `out += h B^T[:w]` is a second: three ops per projection for any number of adapters.
- Triton on CUDA (`astrai.extension.ops.lora`): a segmented gather kernel that reads each
  token's slot and touches only its rank's columns.
`ASTR_LORA_BACKEND=torch|triton` selects one strictly (triton raises where unusable).
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass

import torch

LORA_BACKENDS = ("torch", "triton")


@dataclass
class LoRABatch:
    """Which adapter slot each token of one forward uses.

    `token_slots` `[T]` int32 (-1: the base model); `scalings` `[slots]` each slot's
    `alpha / r` (or rsLoRA's); `mask` `[T, width]`: the token's slot's scaling over that
    slot's `rank` columns, 0 elsewhere (the torch path); `width` = (highest slot in use + 1)
    * rank, the stacked columns the step reads; `active`: some token uses an adapter (a
    step of base rows only skips every delta)."""

    token_slots: torch.Tensor
    scalings: torch.Tensor
    mask: torch.Tensor
    width: int
    active: bool

    @classmethod
    def build(
        cls, token_slots: list[int], scalings: torch.Tensor, rank: int, device: torch.device
    ) -> LoRABatch:
        """The batch of a step whose tokens use `token_slots` (host ints, -1: base)."""
        top = max(token_slots, default=-1)
        slots = torch.tensor(token_slots, dtype=torch.int32)
        width = (top + 1) * rank
        mask = torch.zeros(len(token_slots), width, dtype=scalings.dtype)
        if top >= 0:
            used = slots >= 0
            cols = slots[used].long()[:, None] * rank + torch.arange(rank)
            mask[used.nonzero()[:, :1].expand(-1, rank), cols] = scalings.cpu()[slots[used].long()][
                :, None
            ].expand(-1, rank)
        return cls(
            token_slots=slots.to(device),
            scalings=scalings,
            mask=mask.to(device),
            width=width,
            active=top >= 0,
        )


class LoRAStep:
    """The batch of the forward now running, shared by every adapted projection of one
    model: the runner sets it around each forward with adapter rows; None otherwise. Per
    thread: a training forward on another thread (a policy the engine shares) never sees
    the engine's batch."""

    def __init__(self) -> None:
        self._local = threading.local()

    @property
    def batch(self) -> LoRABatch | None:
        return getattr(self._local, "batch", None)

    @batch.setter
    def batch(self, value: LoRABatch | None) -> None:
        self._local.batch = value


class LoRALayer:
    """One projection's adapter stacks: `a` `[slots * rank, in]`, `bt` `[slots * rank,
    out]` (B transposed), read by `apply` for the step in `step`. The stacks belong to the
    engine's adapter slots, which write each slot in place when an adapter moves in."""

    def __init__(self, a: torch.Tensor, bt: torch.Tensor, rank: int, step: LoRAStep) -> None:
        self.a, self.bt, self.rank, self.step = a, bt, rank, step

    def __reduce__(self) -> tuple:
        # Engine state, not model state: a deep copy or a pickle of the model (an export,
        # a frozen reference) has no adapter slots.
        return (_no_layer, ())

    @property
    def serving(self) -> bool:
        """Whether an engine step with adapter rows runs on this thread now."""
        return self.step.batch is not None

    def apply(self, x: torch.Tensor, out: torch.Tensor) -> None:
        """Add this step's per-token adapter deltas to `out` (the base output of `x`)."""
        batch = self.step.batch
        if batch is None or not batch.active or torch.is_grad_enabled():
            return
        lora_delta(
            x.reshape(-1, x.shape[-1]),
            out.view(-1, out.shape[-1]),
            self.a,
            self.bt,
            self.rank,
            batch,
        )


def _no_layer() -> None:
    return None


def lora_backend() -> str | None:
    """The backend `ASTR_LORA_BACKEND` forces (None: automatic)."""
    forced = os.environ.get("ASTR_LORA_BACKEND") or None
    if forced is not None and forced not in LORA_BACKENDS:
        raise ValueError(f"ASTR_LORA_BACKEND must be one of {LORA_BACKENDS}, got {forced!r}")
    return forced


def lora_delta(
    x: torch.Tensor,
    out: torch.Tensor,
    a: torch.Tensor,
    bt: torch.Tensor,
    rank: int,
    batch: LoRABatch,
) -> None:
    """`out[t] += scalings[s] * (x[t] A_s^T) B_s^T` with `s = batch.token_slots[t]` (no
    change where -1), in place. `x` `[T, in]`, `out` `[T, out]` (a column slice of a packed
    projection's output is fine), `a` / `bt` the stacks `[slots * rank, in | out]`."""
    forced = lora_backend()
    if forced == "triton" or (forced is None and x.is_cuda):
        from astrai.extension.ops import sgmv_lora  # raises where Triton cannot run

        slots = a.shape[0] // rank
        sgmv_lora(
            x,
            a.view(slots, rank, -1),
            bt.view(slots, rank, -1),
            batch.token_slots,
            batch.scalings,
            out,
        )
        return
    w = batch.width
    h = torch.mm(x, a[:w].t()).mul_(batch.mask)
    out.addmm_(h, bt[:w])


__all__ = ["LORA_BACKENDS", "LoRABatch", "LoRALayer", "LoRAStep", "lora_backend", "lora_delta"]
