"""Collectives over the training ranks for statistics that span the whole batch (GRPO's
batch-scaled advantages, its entropy quantile): None on a single process, so callers pass
them on unconditionally."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor


def sum_over_ranks(trainer: Any) -> Callable[[Tensor], Tensor] | None:
    """A function summing a tensor over the trainer's ranks; None: one process (or no
    trainer)."""
    if trainer is None or trainer.world_size == 1:
        return None
    return lambda t: trainer.strategy.reduce(t, reduce_op="sum")


def gather_over_ranks(trainer: Any) -> Callable[[Tensor], Tensor] | None:
    """A function concatenating a 1-d tensor of any length over the trainer's ranks (padded
    to the longest for the collective, the padding dropped after); None: one process."""
    if trainer is None or trainer.world_size == 1:
        return None
    strategy = trainer.strategy

    def gather(t: Tensor) -> Tensor:
        sizes = strategy.all_gather(torch.tensor(t.numel(), device=t.device)).flatten()
        padded = torch.zeros(int(sizes.max()), dtype=t.dtype, device=t.device)
        padded[: t.numel()] = t
        pieces = strategy.all_gather(padded)
        return torch.cat([p[: int(n)] for p, n in zip(pieces, sizes)])

    return gather


def max_over_ranks(trainer: Any) -> Callable[[int], int]:
    """A function taking a count to its largest value over the trainer's ranks (GRPO's
    number of forwards per micro-batch under a token budget); one process: the count."""
    if trainer is None or trainer.world_size == 1:
        return int
    strategy = trainer.strategy

    def largest(n: int) -> int:
        count = torch.tensor(int(n), device=strategy.root_device)
        return int(strategy.reduce(count, reduce_op=torch.distributed.ReduceOp.MAX))

    return largest
