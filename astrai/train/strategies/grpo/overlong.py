"""DAPO's soft overlong punishment (``strategy.overlong_penalty``): one more reward column,
``overlong``, weighted by ``penalty_factor``; equal to TRL's
``trl.rewards.get_soft_overlong_punishment(max_new_tokens, len)`` on completion token counts:
0 up to ``max_new_tokens - len``, then falling linearly to -1 at ``max_new_tokens``."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

#: the reward column's (and the logged part's) name
OVERLONG = "overlong"


class NoOverlong:
    """``overlong_penalty: null``: no column."""

    name = OVERLONG
    weight = 0.0

    def column(self, lengths: Sequence[int]) -> dict[str, list[float]]:
        return {}


@dataclass(frozen=True)
class OverlongPenalty:
    """``{len: L_cache, penalty_factor: 1.0}`` over ``max_new_tokens`` (``L_max``)."""

    max_new_tokens: int
    len: int
    penalty_factor: float = 1.0
    name = OVERLONG

    @property
    def weight(self) -> float:
        return self.penalty_factor

    def value(self, length: int) -> float:
        start = self.max_new_tokens - self.len
        if length <= start:
            return 0.0
        if length <= self.max_new_tokens:
            return (start - length) / self.len
        return -1.0

    def column(self, lengths: Sequence[int]) -> dict[str, list[float]]:
        return {OVERLONG: [self.value(int(n)) for n in lengths]}

    @classmethod
    def parse(cls, spec: Any, max_new_tokens: int) -> OverlongPenalty | NoOverlong:
        """The option as the YAML gives it (None: off); errors name ``overlong_penalty``."""
        if spec is None:
            return NoOverlong()
        if not isinstance(spec, Mapping) or "len" not in spec:
            raise ValueError(
                f"GRPO overlong_penalty must be null or {{len: L_cache, penalty_factor: 1.0}}, "
                f"got {spec!r}"
            )
        unknown = sorted(set(spec) - {"len", "penalty_factor"})
        if unknown:
            raise ValueError(f"GRPO overlong_penalty: unknown keys {unknown}")
        length = spec["len"]
        if isinstance(length, bool) or not isinstance(length, int) or length < 1:
            raise ValueError(f"GRPO overlong_penalty.len must be an int >= 1, got {length!r}")
        if length > max_new_tokens:
            raise ValueError(
                f"GRPO overlong_penalty.len ({length}) must be at most max_new_tokens "
                f"({max_new_tokens}): the buffer is the last len tokens of the budget"
            )
        factor = float(spec.get("penalty_factor", 1.0))
        if not math.isfinite(factor) or factor < 0:
            raise ValueError(f"GRPO overlong_penalty.penalty_factor must be >= 0, got {factor}")
        return cls(int(max_new_tokens), int(length), factor)


Overlong = OverlongPenalty | NoOverlong
