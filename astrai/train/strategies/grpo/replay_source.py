"""A step ledger's recorded rollouts as a :class:`RolloutSource`: a replay trains on exactly
the samples the run trained on (no engine samples), found by their seed."""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import Any

from astrai.train.strategies.grpo.sampling import Samples
from astrai.train.strategies.grpo.source import RolloutSource


class ReplaySource(RolloutSource):
    """``rollout(seed)`` is the ledger's record of the batch of that seed (a mapping with
    at least :class:`Samples`' fields). ``replaced``, the source the module had, samples
    nothing; it keeps its checkpoint entries and is closed with this one."""

    def __init__(self, rollout: Callable[[int], Mapping[str, Any]], replaced: RolloutSource):
        self.rollout = rollout
        self.replaced = replaced

    def take(self, batch: Mapping[str, Any], seed: int, step: int) -> Samples:
        started = time.perf_counter()
        fields = set(Samples.__dataclass_fields__)
        record = self.rollout(seed)
        samples = Samples(**{k: v for k, v in record.items() if k in fields})
        self.waited = time.perf_counter() - started
        return samples

    def state_dict(self) -> dict[str, Any]:
        return self.replaced.state_dict()

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.replaced.load_state_dict(state)

    def close(self) -> None:
        self.replaced.close()
