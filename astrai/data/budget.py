"""Training batches by token budget (verl's ``data.use_dynamic_bsz`` and
``data.max_token_len_per_gpu``): each loader batch is one padding-free row of whole samples
holding at most ``max_token_len_per_gpu`` tokens, so the number of samples per batch varies
and a batch of short samples is not padded up to, nor limited by, the longest one.

The cuts are taken from the epoch's global order (:meth:`ResumableSampler.epoch_order`, the
same on every rank): from the epoch's current position, a batch takes the next samples of the
order while their total length stays within the budget. Batches go to the ranks round-robin,
``world`` consecutive batches making one step of all ranks, so every rank takes the same
number of steps; the last, incomplete group is dropped with ``drop_last``, else completed with
the epoch's first batches (as :class:`~torch.utils.data.DistributedSampler` repeats samples).

A batch is a run of consecutive positions of the order and a step takes whole batches, so the
data position stays a count of samples: after ``consumed`` samples, the used ones are exactly
the first ``consumed`` positions. The greedy cut from a batch boundary reproduces the cuts an
uninterrupted epoch makes, so a resume continues with the very batches the uninterrupted run
takes; a resume with another number of ranks, or another budget, loses and repeats nothing.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
from torch.utils.data import Dataset

from astrai.data.datasets import PretrainDataset, SFTDataset
from astrai.data.sampler import BatchReuse, ResumableSampler
from astrai.data.seeded import SeededSamples

BUDGET_KEY = "data.max_token_len_per_gpu"
#: verl's default ``max_token_len_per_gpu`` (its SFT trainer's)
DEFAULT_MAX_TOKENS = 8192


def budget_ends(lengths: np.ndarray, budget: int) -> np.ndarray:
    """End positions (exclusive) of the greedy cuts of ``lengths``, in order, into runs of at
    most ``budget`` tokens (every length must be within the budget: :func:`check_lengths`)."""
    bounds = np.concatenate([[0], np.cumsum(lengths, dtype=np.int64)])
    ends: list[int] = []
    position = 0
    while position < len(lengths):
        position = int(np.searchsorted(bounds, bounds[position] + budget, side="right")) - 1
        ends.append(position)
    return np.asarray(ends, dtype=np.int64)


def check_budget(max_tokens: Any) -> int:
    """``data.max_token_len_per_gpu`` as a positive int, or a ValueError naming the key."""
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
        raise ValueError(
            f"{BUDGET_KEY} must be a positive integer (tokens of one batch per device), got "
            f"{max_tokens!r}"
        )
    return max_tokens


def check_lengths(lengths: np.ndarray, max_tokens: int) -> None:
    """Every sample must fit the budget whole: as verl (``max_token_len must be greater than
    the sequence length``), a longer sample is refused, never cut."""
    if len(lengths) and int(lengths.max()) > max_tokens:
        index = int(lengths.argmax())
        raise ValueError(
            f"{BUDGET_KEY}={max_tokens} is less than the longest training sample (sample "
            f"{index}: {int(lengths[index])} tokens); a batch holds whole samples (verl refuses "
            f"the same): raise {BUDGET_KEY} to at least {int(lengths[index])}, or shorten the "
            "samples (data.train.max_length, window_size)"
        )


class TokenBudgetSampler(ResumableSampler):
    """Yields this rank's batches (lists of sample indices) of at most ``max_tokens`` tokens,
    cut from the epoch's global order (see the module's docstring).

    Its state is :class:`ResumableSampler`'s: ``consumed`` counts samples of the epoch's
    order used by all ranks together, always at the end of a step's last batch.
    """

    def __init__(
        self,
        lengths: np.ndarray,
        max_tokens: int,
        *,
        seed: int = 0,
        shuffle: bool = True,
        rank: int = 0,
        world_size: int = 1,
        drop_last: bool = False,
    ) -> None:
        lengths = np.asarray(lengths, dtype=np.int64)
        self.max_tokens = check_budget(max_tokens)
        check_lengths(lengths, self.max_tokens)
        super().__init__(
            len(lengths),
            seed=seed,
            shuffle=shuffle,
            rank=rank,
            world_size=world_size,
            drop_last=drop_last,
        )
        self.lengths = lengths
        self._cuts: dict[tuple[int, int], tuple[np.ndarray, np.ndarray]] = {}

    def cuts(self, start: int) -> tuple[np.ndarray, np.ndarray]:
        """``(order, ends)``: the current epoch's order and the end positions of the batches cut
        from position ``start`` on (computed once per epoch and start)."""
        key = (self.epoch, start)
        if key not in self._cuts:
            if len(self._cuts) > 3:
                self._cuts.clear()
            order = self.epoch_order().numpy()
            ends = start + budget_ends(self.lengths[order[start:]], self.max_tokens)
            self._cuts[key] = (order, ends)
        return self._cuts[key]

    def _steps(self, batches: int) -> int:
        if self.drop_last:
            return batches // self.world_size
        return -(-batches // self.world_size)

    def batches_from(self, start: int) -> list[tuple[int, int]]:
        """Every rank's batches from ``start`` to the epoch's end, as ``(first, end)`` positions
        of the order; step ``k`` gives rank ``r`` entry ``k * world + r``. A last group short of
        ``world`` batches is completed with the epoch's first ones (dropped with drop_last)."""
        _, ends = self.cuts(start)
        batches = list(zip([start, *ends[:-1].tolist()], ends.tolist()))
        needed = self._steps(len(batches)) * self.world_size
        if needed > len(batches):
            _, first_ends = self.cuts(0)
            first = list(zip([0, *first_ends[:-1].tolist()], first_ends.tolist()))
            while len(batches) < needed:
                batches += first[: needed - len(batches)]
        return batches[:needed]

    def __iter__(self) -> Iterator[list[int]]:  # type: ignore[override]
        if self.consumed >= self.num_samples_total:  # epoch finished without set_epoch()
            self.start_epoch(self.epoch + 1)
        start = self.consumed
        order, _ = self.cuts(start)
        batches = self.batches_from(start)
        return self._advance_batches(order, batches, start)

    def _advance_batches(
        self, order: np.ndarray, batches: list[tuple[int, int]], start: int
    ) -> Iterator[list[int]]:
        for step in range(len(batches) // self.world_size):
            first, end = batches[step * self.world_size + self.rank]
            self.consumed = self.consumed_after(start, step + 1, 0)
            yield order[first:end].tolist()

    def __len__(self) -> int:
        """At least the steps of any epoch: one sample per batch, ``ResumableSampler``'s count
        per rank. The cuts of each epoch differ, so their steps do; Lightning reads the length
        once (``num_training_batches``) and would end every epoch there, so it gets a bound
        that no epoch reaches, and each epoch ends when its batches do (``is_last_batch``)."""
        return self._per_rank(self.num_samples_total)

    def steps(self) -> int:
        """The steps every rank takes in the rest of the current epoch."""
        _, ends = self.cuts(self.consumed)
        return self._steps(len(ends))

    def consumed_after(self, start: int, batches: int, batch_size: int) -> int:
        """The position after every rank took ``batches`` batches from ``start``
        (``batch_size`` does not apply: a batch holds what the budget allows)."""
        if batches <= 0:
            return start
        _, ends = self.cuts(start)
        taken = batches * self.world_size
        return int(ends[taken - 1]) if taken <= len(ends) else self.num_samples_total


class SampleLists(Dataset):
    """The training samples fetched a batch at a time: item ``[i, j, ...]`` is the list of
    samples ``i, j, ...`` (a DataLoader with ``batch_size=None`` over a sampler of index lists;
    the collate function then sees the list as a batch)."""

    def __init__(self, samples: SeededSamples) -> None:
        self.samples = samples

    def set_epoch(self, epoch: int) -> None:
        self.samples.set_epoch(epoch)

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, indices: list[int]) -> list[Any]:  # type: ignore[override]
        return [self.samples[i] for i in indices]


class FixedBatches:
    """``data.batch_size`` samples per loader batch (the default)."""

    def check(self, train: Dataset | None) -> None:
        """Nothing to check beyond the data module's own settings."""

    def sampler(self, train: Dataset, **options: Any) -> ResumableSampler:
        return ResumableSampler(len(train), **options)

    def loader_options(
        self, samples: SeededSamples, batch_size: int, drop_last: bool, reuse: BatchReuse
    ) -> dict[str, Any]:
        return {"dataset": samples, "batch_size": batch_size * reuse.group, "drop_last": drop_last}


class TokenBudget(FixedBatches):
    """``data.use_dynamic_bsz``: batches of whole samples within ``max_tokens`` tokens,
    by :class:`TokenBudgetSampler` (``data.batch_size`` then sizes validation batches only)."""

    def __init__(self, max_tokens: int) -> None:
        self.max_tokens = check_budget(max_tokens)

    def check(self, train: Dataset | None) -> None:
        """The training samples' lengths fit the budget (at set-up, before the first step)."""
        if train is not None:
            check_lengths(self.lengths(train), self.max_tokens)

    def lengths(self, train: Dataset) -> np.ndarray:
        if not isinstance(train, PretrainDataset | SFTDataset):
            raise ValueError(
                f"data.use_dynamic_bsz cuts pretrain and SFT batches by their tokens; data.train "
                f"is a {type(train).__name__}"
            )
        return train.token_lengths()

    def sampler(self, train: Dataset, **options: Any) -> ResumableSampler:
        return TokenBudgetSampler(self.lengths(train), self.max_tokens, **options)

    def loader_options(
        self, samples: SeededSamples, batch_size: int, drop_last: bool, reuse: BatchReuse
    ) -> dict[str, Any]:
        if reuse.group != 1:
            raise ValueError(
                "data.use_dynamic_bsz: this strategy takes several loader batches' samples per "
                f"step ({reuse.group}); set data.use_dynamic_bsz=false"
            )
        return {"dataset": SampleLists(samples), "batch_size": None, "drop_last": False}


def training_batches(
    padding_free: bool = False,
    use_dynamic_bsz: Any = False,
    max_token_len_per_gpu: Any = DEFAULT_MAX_TOKENS,
) -> FixedBatches:
    """How training batches are made, from the ``data`` settings of these names; bad settings
    are refused naming the key (by the data module, and before the run by its preflight)."""
    if not isinstance(use_dynamic_bsz, bool):
        raise ValueError(f"data.use_dynamic_bsz must be true or false, got {use_dynamic_bsz!r}")
    budget = TokenBudget(max_token_len_per_gpu)  # checks data.max_token_len_per_gpu
    if not use_dynamic_bsz:
        return FixedBatches()
    if padding_free is not True:
        raise ValueError(
            "data.use_dynamic_bsz=true cuts each training batch as one padding-free row of at "
            "most data.max_token_len_per_gpu tokens; it needs data.padding_free=true"
        )
    return budget
