"""The training loader of :class:`astrai.data.AstraiDataModule` (cut out of its module).

It tells its data module when an epoch starts and each batch it yields, seeds its workers
from (seed, epoch), and yields a batch reused by several steps that many times; the data
module counts positions (see :mod:`astrai.data.datamodule`).
"""

from __future__ import annotations

import collections
from collections.abc import Iterator
from typing import Any, Protocol

from torch.utils.data import DataLoader

from astrai.data.sampler import ResumableSampler

__all__ = ["LoaderOwner", "TrainLoader", "with_upcoming"]


class LoaderOwner(Protocol):
    """What the training loader needs of its data module (``AstraiDataModule``)."""

    sampler: ResumableSampler | None
    repeats_done: int

    def start_train_iteration(self) -> None: ...

    def loader_yielded_batch(self) -> None: ...

    def loader_seed(self, epoch: int) -> int: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state_dict: dict[str, Any]) -> None: ...


class TrainLoader(DataLoader):
    """DataLoader that tells its datamodule when an epoch starts and each batch it yields.

    Its ``state_dict`` / ``load_state_dict`` are the datamodule's, which makes it resumable in
    Lightning's eyes too (Lightning then stores the same position with the loop state and
    does not warn that a mid-epoch checkpoint cannot be resumed exactly).
    """

    def __init__(
        self,
        *args: Any,
        datamodule: LoaderOwner,
        repeat: int = 1,
        lookahead: int = 0,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        self.datamodule = datamodule
        self.repeat = repeat
        self.lookahead = lookahead

    def __len__(self) -> int:
        return super().__len__() * self.repeat

    def state_dict(self) -> dict[str, Any]:
        return self.datamodule.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.datamodule.load_state_dict(state_dict)

    def __iter__(self) -> Iterator[Any]:
        self.datamodule.start_train_iteration()
        # The iterator draws the workers' base seed from this generator (never from the
        # global RNG the training step uses), seeded by (seed, epoch): a resumed epoch gives
        # its workers the same seeds as the uninterrupted one; each sample is fetched under
        # RNGs seeded by (seed, epoch, index) (`SeededSamples`).
        epoch = self.datamodule.sampler.epoch
        self.generator.manual_seed(self.datamodule.loader_seed(epoch))
        self.dataset.set_epoch(epoch)
        # A batch reused by several steps (`BatchReuse`) is yielded that many times; a resumed
        # run yields the first one only as often as the interrupted run had not.
        skip = self.datamodule.repeats_done
        for batch in with_upcoming(super().__iter__(), self.lookahead):
            for _ in range(self.repeat - skip):
                self.datamodule.loader_yielded_batch()
                yield batch
            skip = 0


def with_upcoming(batches: Iterator[Any], lookahead: int) -> Iterator[Any]:
    """Each batch (a mapping) with ``upcoming``: the next ``lookahead`` batches of the same
    epoch, drawn ahead of their turn (asynchronous GRPO samples them early). Drawing ahead
    moves no position: the data module counts the batches the training step receives."""
    if lookahead <= 0:
        yield from batches
        return
    window: collections.deque[Any] = collections.deque()
    for batch in batches:
        window.append(batch)
        if len(window) > lookahead:
            head = window.popleft()
            yield {**head, "upcoming": list(window)}
    while window:
        head = window.popleft()
        yield {**head, "upcoming": list(window)}
