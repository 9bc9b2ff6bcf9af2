"""A sampler whose position survives checkpoints, also across a change in the number of ranks.

The order of an epoch is one global permutation, a function of ``(seed, epoch)`` only. Ranks
take the remaining positions round-robin: after ``consumed`` samples of the epoch have been
used (by all ranks together), rank ``r`` of ``w`` takes global positions
``consumed + r, consumed + r + w, ...``. Since ranks advance in lockstep, the samples used so far
are exactly the first ``consumed`` positions, whatever the number of ranks was; resuming from
``consumed`` with any number of ranks therefore loses and repeats nothing.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.data import DistributedSampler


class ResumableSampler(DistributedSampler):
    """Deterministic, rank-sharded, resumable sampler over ``num_samples`` indices.

    Subclasses :class:`~torch.utils.data.DistributedSampler` only so that Lightning recognises it
    as already distributed and does not wrap it in a second sampler; all logic is here.

    Args:
        num_samples: size of the dataset.
        seed: base seed; the epoch order is a permutation seeded with ``seed + epoch``.
        shuffle: permute (``True``) or keep index order.
        rank, world_size: this process and the number of processes.
        drop_last: drop the tail that does not divide evenly among ranks; otherwise ranks that
            would get one sample fewer repeat the first samples of the epoch order (as
            :class:`DistributedSampler` does) so that all ranks take the same number of steps.

    ``state_dict()`` is ``{"epoch", "consumed", "seed", "world_size", "num_samples",
    "epoch_offset"}`` (see :meth:`set_epoch` for the last) where ``consumed`` counts samples of the current epoch used by all ranks together. Iterating
    advances it by ``world_size`` per yielded index, which is exact when indices are consumed
    as they are drawn (``num_workers=0``); :class:`~astrai.data.AstraiDataModule` overrides it
    with the number of samples the training loop actually received.
    """

    def __init__(
        self,
        num_samples: int,
        *,
        seed: int = 0,
        shuffle: bool = True,
        rank: int = 0,
        world_size: int = 1,
        drop_last: bool = False,
    ) -> None:
        if num_samples <= 0:
            raise ValueError(f"ResumableSampler: num_samples must be positive, got {num_samples}")
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"ResumableSampler: invalid rank {rank} for world_size {world_size}")
        super().__init__(
            range(num_samples),
            num_replicas=world_size,
            rank=rank,
            shuffle=shuffle,
            seed=seed,
            drop_last=drop_last,
        )
        self.num_samples_total = num_samples
        self.world_size = world_size
        self.epoch = 0
        self.consumed = 0
        # Lightning's epoch count minus the sampler's (see set_epoch)
        self.epoch_offset = 0
        self._restored_midway = False
        # what __len__ reports for a resumed epoch: samples this rank is deemed to have taken
        # before the resume (consumed // saved world size) plus what is left for it now, so
        # that a loop counting batches since the epoch start (Lightning) stays consistent.
        self._resume_consumed = 0
        self._resume_world_size = world_size

    # -- order ------------------------------------------------------------------------------
    def epoch_order(self, epoch: int | None = None) -> torch.Tensor:
        """The global order of an epoch (same on every rank)."""
        epoch = self.epoch if epoch is None else epoch
        if not self.shuffle:
            return torch.arange(self.num_samples_total)
        g = torch.Generator()
        g.manual_seed(self.seed + epoch)
        return torch.randperm(self.num_samples_total, generator=g)

    def _per_rank(self, remaining: int) -> int:
        if self.drop_last:
            return remaining // self.world_size
        return math.ceil(remaining / self.world_size)

    def _rank_indices(self) -> list[int]:
        order = self.epoch_order()
        remaining = order[self.consumed :]
        count = self._per_rank(len(remaining))
        needed = count * self.world_size
        if needed > len(remaining):  # pad from the start of the epoch order
            reps = math.ceil((needed - len(remaining)) / len(order))
            remaining = torch.cat([remaining, *([order] * reps)])[:needed]
        return remaining[self.rank : needed : self.world_size].tolist()

    # -- Sampler protocol ---------------------------------------------------------------------
    def __iter__(self) -> Iterator[int]:
        if self.consumed >= self.num_samples_total:  # epoch finished without set_epoch()
            self.start_epoch(self.epoch + 1)
        indices = self._rank_indices()
        return self._advance(indices)

    def _advance(self, indices: list[int]) -> Iterator[int]:
        for index in indices:
            self.consumed = min(self.consumed + self.world_size, self.num_samples_total)
            yield index

    def __len__(self) -> int:
        before = self._resume_consumed // self._resume_world_size
        return before + self._per_rank(self.num_samples_total - self._resume_consumed)

    def consumed_after(self, start: int, batches: int, batch_size: int) -> int:
        """The epoch's position after every rank took ``batches`` loader batches of
        ``batch_size`` samples from position ``start``."""
        return min(start + batches * batch_size * self.world_size, self.num_samples_total)

    def set_epoch(self, epoch: int) -> None:
        """Lightning's call at every epoch start, with its own epoch count: start that epoch
        from its beginning; a no-op when already in it (mid-epoch resume).

        Lightning's count can run ahead of the data: a run stopped by ``max_steps`` in the
        middle of an epoch is checkpointed as if the epoch had ended, and resumed (with a
        larger ``max_steps``) it starts the next one. The data does not skip the rest of the
        epoch: the first call after such a restore keeps the saved position and records the
        difference (``epoch_offset``, kept in the state), which later calls subtract.
        """
        epoch -= self.epoch_offset
        restored, self._restored_midway = self._restored_midway, False
        if restored and epoch > self.epoch:
            self.epoch_offset += epoch - self.epoch
            return
        self.start_epoch(epoch)

    def start_epoch(self, epoch: int) -> None:
        """Start the sampler's ``epoch`` (its own count) from its beginning; a no-op when
        already in it."""
        if epoch != self.epoch:
            self.epoch = epoch
            self.consumed = 0
            self._resume_consumed = 0
            self._resume_world_size = self.world_size

    # -- state --------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {
            "epoch": self.epoch,
            "consumed": self.consumed,
            "seed": self.seed,
            "world_size": self.world_size,
            "num_samples": self.num_samples_total,
            "epoch_offset": self.epoch_offset,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue at the first unseen sample of the saved epoch, with any number of ranks."""
        if "mixture" in state:  # (MixtureSampler takes it out before it calls this)
            names = state["mixture"].get("names")
            raise ValueError(
                f"ResumableSampler: the saved position is for a mixture of data.train.sources "
                f"{names}, this run reads one source; resume with the sources it was trained on"
            )
        num = state.get("num_samples", self.num_samples_total)
        if num != self.num_samples_total:
            raise ValueError(
                f"ResumableSampler: the saved position is for {num} samples but the dataset has "
                f"{self.num_samples_total}; resume with the same data, or start a new run and "
                f"load only the weights"
            )
        if state.get("seed", self.seed) != self.seed:
            raise ValueError(
                f"ResumableSampler: the saved position is for seed {state['seed']} but this "
                f"sampler has seed {self.seed}; the order would differ"
            )
        consumed = int(state["consumed"])
        if not 0 <= consumed <= self.num_samples_total:
            raise ValueError(f"ResumableSampler: consumed={consumed} outside the epoch")
        self.epoch = int(state["epoch"])
        self.epoch_offset = int(state.get("epoch_offset", 0))
        self._restored_midway = 0 < consumed < self.num_samples_total
        self.consumed = consumed
        self._resume_consumed = consumed
        self._resume_world_size = int(state.get("world_size", self.world_size))


@dataclass(frozen=True)
class BatchReuse:
    """How the training loop consumes loader batches: each holds ``group`` x ``batch_size``
    samples and is handed to ``repeat`` consecutive training steps (TRL's ``RepeatSampler``).

    GRPO's generation batch: ``steps_per_generation`` micro-steps' prompts generated at once,
    then trained on over ``steps_per_generation * num_iterations`` micro-steps. A module
    declares it as :attr:`BatchConsumer.batch_reuse` (``LMModule`` is one); the default
    reuses nothing.
    """

    group: int = 1
    repeat: int = 1

    def __post_init__(self) -> None:
        if self.group < 1 or self.repeat < 1:
            raise ValueError(f"BatchReuse: group and repeat must be >= 1, got {self}")


class BatchConsumer:
    """What a LightningModule declares about how it consumes training loader batches, read
    by ``AstraiDataModule`` (``astrai.train.module.LMModule`` is one; a module that is not
    gets the defaults): each loader batch's reuse and how many later batches the loader
    shows ahead (``batch["upcoming"]``, for asynchronous rollouts)."""

    @property
    def batch_reuse(self) -> BatchReuse:
        return BatchReuse()

    @property
    def batch_lookahead(self) -> int:
        return 0
