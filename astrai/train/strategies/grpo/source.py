"""Where GRPO's rollouts come from: a :class:`RolloutSource` (verl's rollout worker, behind
one interface).

The module holds one source, chosen once: the engine on the live policy
(:class:`~astrai.train.strategies.grpo.engine_source.EngineSource`), a generator thread
wrapping one on a copy of the policy
(:class:`~astrai.train.strategies.grpo.async_source.AsyncSource`), or a step ledger's
recorded samples (:class:`~astrai.train.strategies.grpo.replay_source.ReplaySource`).
Callbacks reach it through :class:`RolloutModule` (the ledger wraps it to record, a replay
replaces it), never through attributes they discover.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from typing import Any

from astrai.train.strategies.grpo.sampling import Samples


def rollout_index(trainer: Any, ahead: int = 0) -> int:
    """Which rank's which training micro-batch this is (``ahead`` micro-batches on), counted
    over all ranks: what seeds a micro-batch's rollouts, so every rank samples its own and a
    resumed or replayed run samples the same. ``trainer`` None (no fit): micro-batch 0."""
    try:
        micro = int(trainer.fit_loop.epoch_loop.batch_progress.total.ready)
    except (AttributeError, RuntimeError):
        micro = 0
    micro += ahead
    if trainer is None or trainer.world_size == 1:
        return micro
    return micro * int(trainer.world_size) + int(trainer.global_rank)


class RolloutSource(ABC):
    """Hands over the samples of one loader batch.

    ``take(batch, seed, step)``: ``batch`` is the loader's (``prompt_ids``, ``records`` and,
    with lookahead, ``upcoming``), ``seed`` the batch's rollout seed, ``step`` the optimizer
    step whose weights are current (the policy version). ``waited`` is how long the last
    take waited for its samples (the trainer's idle time). Checkpoint entries are top-level
    keys of the Lightning checkpoint (``grpo_pending``), so older checkpoints load.
    """

    waited: float = 0.0

    @abstractmethod
    def take(self, batch: Mapping[str, Any], seed: int, step: int) -> Samples: ...

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        return None

    def close(self) -> None:
        return None


#: sees each generation batch once it is scored: ``(step, samples, advantages)``, the
#: advantages ``[N]`` or completion-aligned ``[N, T]`` (the completions log)
RolloutObserver = Callable[[int, Samples, Any], None]


class RolloutModule(ABC):
    """A module that trains on rollouts: what the step ledger and a replay may change, and
    what callbacks may watch (``observe_rollouts``)."""

    rollout_observers: tuple[RolloutObserver, ...] = ()

    def observe_rollouts(self, observer: RolloutObserver) -> None:
        """Call ``observer`` with every generation batch from now on."""
        self.rollout_observers = (*self.rollout_observers, observer)

    @abstractmethod
    def wrap_source(self, wrap: Callable[[RolloutSource], RolloutSource]) -> None:
        """Replace the module's source by ``wrap(source)`` (which may keep the old one)."""


class WrappingSource(RolloutSource):
    """A source over ``inner``: its checkpoint entries and its closing are ``inner``'s."""

    def __init__(self, inner: RolloutSource) -> None:
        self.inner = inner

    def state_dict(self) -> dict[str, Any]:
        return self.inner.state_dict()

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.inner.load_state_dict(state)

    def close(self) -> None:
        self.inner.close()


class RecordingSource(WrappingSource):
    """``inner``'s samples, each also handed to ``record(seed, samples)`` (the ledger)."""

    def __init__(self, inner: RolloutSource, record: Callable[[int, Samples], None]) -> None:
        super().__init__(inner)
        self.record = record

    def take(self, batch: Mapping[str, Any], seed: int, step: int) -> Samples:
        samples = self.inner.take(batch, seed, step)
        self.waited = self.inner.waited
        self.record(seed, samples)
        return samples
