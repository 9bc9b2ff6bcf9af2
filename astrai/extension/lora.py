"""Many LoRA adapters over one base in one batch: the per-token low-rank delta.

The engine keeps the adapters it serves in slots (`astrai.inference.adapters`): for each
adapted projection one stack of A matrices `[slots * rank, in]` and one of B transposed
`[slots * rank, out]`, ranks zero-padded to the engine's `max_lora_rank`, so a lower-rank
adapter adds exact zeros. Each token of a step names its slot (`LoRABatch.token_slots`,
-1 for the base model) and `lora_delta` adds `scaling * (x A^T) B^T` of that slot to the
base projection's output, in place: one call per projection whatever the mix of adapters.

Two implementations behind this one entry point (S-LoRA / Punica's gathered product):
- plain torch (the CPU, and any device without Triton): when every token uses one adapter,
  two products with its slot; otherwise the step's tokens grouped by slot (padded to the
  largest group, laid out once per step in `LoRABatch`), gathered, two batched products
  against the slots' stacks, and the real rows' results scattered back with `index_add_`:
  six ops per projection whatever the mix, and the multiply-adds of each token's own rank
  only. A padding row's result is dropped, never added as `0 * delta`: a diverged
  adapter's NaN or inf times 0 is NaN, which would reach another request's row. (Multiplying
  every token by every slot in use and masking costs a product per slot per token: on the
  benchmark machine twice the time at 4 adapters, experiments/bench/lora.md.)
- Triton on CUDA (`astrai.extension.ops.lora`): a segmented gather kernel that reads each
  token's slot and touches only its rank's columns.
`ASTR_LORA_BACKEND=torch|triton` selects one strictly (triton raises where unusable).
In batch-invariant mode (`astrai.extension.invariance`) neither: per adapter in use, its
tokens' two products in fixed row blocks, so a token's delta is the same bits whatever
else the step holds.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from astrai.extension.invariance import batch_invariant_enabled, in_row_blocks

LORA_BACKENDS = ("torch", "triton")


@dataclass
class LoRABatch:
    """Which adapter slot each token of one forward uses, laid out once per step for every
    adapted projection.

    `token_slots` `[T]` int32 (-1: the base model) and `scalings` `[slots]` (each slot's
    `alpha / r`, or rsLoRA's) serve the Triton kernel. The torch path groups the tokens by
    slot: `single` = `(slot, scaling)` when every token uses one slot (two products, no
    gather); otherwise `rows` `[G * M]` the token indices of the `G` slots in use, each
    group padded to `M` with its own first token, `groups` `[G]` their slots (None: slots
    0..G-1, a view of the stacks), `scale` `[G, 1, 1]` the slots' scalings, `kept` `[N]`
    the positions in `rows` of the real tokens (None: no padding) and `targets` `[N]` their
    token indices, where the results are added. `active`: some token uses an adapter."""

    token_slots: torch.Tensor
    scalings: torch.Tensor
    active: bool
    single: tuple[int, float] | None = None
    rows: torch.Tensor | None = None
    groups: torch.Tensor | None = None
    scale: torch.Tensor | None = None
    kept: torch.Tensor | None = None
    targets: torch.Tensor | None = None

    @classmethod
    def build(
        cls,
        token_slots: list[int],
        scalings: torch.Tensor,
        rank: int,
        device: torch.device,
        host_scalings: Sequence[float] | None = None,
    ) -> LoRABatch:
        """The batch of a step whose tokens use `token_slots` (host ints, -1: base);
        `host_scalings`, `scalings` on the host, spares a device sync per step."""
        slots = torch.tensor(token_slots, dtype=torch.int32, device=device)
        by_slot: dict[int, list[int]] = {}
        for t, slot in enumerate(token_slots):
            if slot >= 0:
                by_slot.setdefault(slot, []).append(t)
        if not by_slot:
            return cls(slots, scalings, active=False)
        host = scalings.tolist() if host_scalings is None else host_scalings
        if len(by_slot) == 1 and len(next(iter(by_slot.values()))) == len(token_slots):
            (slot,) = by_slot
            return cls(slots, scalings, active=True, single=(slot, host[slot]))
        used = sorted(by_slot)
        m = max(len(v) for v in by_slot.values())
        rows, kept, targets = [], [], []
        for g, s in enumerate(used):
            tokens = by_slot[s]
            rows += tokens + tokens[:1] * (m - len(tokens))
            kept += range(g * m, g * m + len(tokens))
            targets += tokens
        padded = len(targets) < len(rows)
        scale = torch.tensor([host[s] for s in used], dtype=scalings.dtype, device=device)

        def tensor(values: list[int]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.long, device=device)

        return cls(
            slots,
            scalings,
            active=True,
            rows=tensor(rows),
            groups=None if used == list(range(len(used))) else tensor(used),
            scale=scale[:, None, None],
            kept=tensor(kept) if padded else None,
            targets=tensor(targets) if padded else None,
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
    if batch_invariant_enabled():
        _invariant_delta(x, out, a, bt, rank, batch)
        return
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
    if batch.single is not None:  # every token on one adapter: two products
        slot, scaling = batch.single
        r0, r1 = slot * rank, (slot + 1) * rank
        out.addmm_(torch.mm(x, a[r0:r1].t()), bt[r0:r1], alpha=scaling)
        return
    # Tokens grouped by slot (padded): one batched product per side, then scattered back.
    slots = a.shape[0] // rank
    a3, bt3 = a.view(slots, rank, -1), bt.view(slots, rank, -1)
    groups = batch.scale.shape[0]
    if batch.groups is None:
        a3, bt3 = a3[:groups], bt3[:groups]
    else:
        a3, bt3 = a3.index_select(0, batch.groups), bt3.index_select(0, batch.groups)
    xs = x.index_select(0, batch.rows).view(groups, -1, x.shape[-1])
    h = torch.bmm(xs, a3.transpose(1, 2)).mul_(batch.scale)
    y = torch.bmm(h, bt3).view(-1, bt3.shape[-1])
    if batch.kept is None:  # no padding: every row of `y` is a real token's
        out.index_add_(0, batch.rows, y)
    else:
        out.index_add_(0, batch.targets, y.index_select(0, batch.kept))


def _invariant_delta(
    x: torch.Tensor,
    out: torch.Tensor,
    a: torch.Tensor,
    bt: torch.Tensor,
    rank: int,
    batch: LoRABatch,
) -> None:
    """`lora_delta` batch-invariantly: per slot in use, `(x A^T) B^T` of its tokens in fixed
    row blocks, times the slot's scaling, added to their rows (one add per element)."""
    slots = batch.token_slots
    for slot in torch.unique(slots[slots >= 0]).tolist():
        tokens = (slots == slot).nonzero().squeeze(1)
        a_s, bt_s = a[slot * rank : (slot + 1) * rank], bt[slot * rank : (slot + 1) * rank]
        h = in_row_blocks(x.index_select(0, tokens), lambda z, a_s=a_s: torch.mm(z, a_s.t()))
        y = in_row_blocks(h, lambda z, bt_s=bt_s: torch.mm(z, bt_s))
        out.index_add_(0, tokens, y.mul_(batch.scalings[slot]))


__all__ = ["LORA_BACKENDS", "LoRABatch", "LoRALayer", "LoRAStep", "lora_backend", "lora_delta"]
