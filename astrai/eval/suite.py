"""The one interface every evaluation suite implements, and the result it returns.

A suite holds its items (read and checked when it is built, so a bad task file fails before
any model is loaded) and scores them on an engine it is handed: `python -m astrai.eval`
builds one engine for all its suites, the training callback builds one on the live weights.
A suite talks to the engine only through `engine.tokenizer`, `engine.run_batch(...)` and
`engine.score(...)`, and every request it makes names its `adapter` (a LoRA adapter the
engine has loaded; None: the base model), so one suite evaluates a base or an adapter.
"""

from __future__ import annotations

import dataclasses
from abc import ABC, abstractmethod
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from tqdm import tqdm

from astrai.inference.params import SamplingParams

if TYPE_CHECKING:
    from astrai.inference import InferenceEngine
    from astrai.tokenizer import AutoTokenizer

__all__ = ["Suite", "SuiteResult", "progress_bar"]


@dataclass
class SuiteResult:
    """What one run of a suite produced: scalar metrics and one sample row per item."""

    name: str
    metrics: dict[str, float]
    samples: list[dict[str, Any]] = field(default_factory=list)
    seconds: float = 0.0

    def to_dict(self, samples: bool = True) -> dict[str, Any]:
        out = asdict(self)
        if not samples:
            out.pop("samples")
        return out


class Suite(ABC):
    """An evaluation over fixed items; `name` is its metric namespace (`eval/<name>/<metric>`)."""

    name: str
    #: the engine adapter every request of this suite names (None: the base model); the
    #: runner sets it (`python -m astrai.eval adapter=DIR`)
    adapter: str | None = None

    def request(self, params: SamplingParams) -> SamplingParams:
        """`params` naming this suite's `adapter`: the one place a suite's requests get it."""
        if self.adapter is None or params.adapter == self.adapter:
            return params
        return dataclasses.replace(params, adapter=self.adapter)

    def score_params(self) -> SamplingParams | None:
        """The settings of this suite's `engine.score` calls (None: the engine's defaults)."""
        return None if self.adapter is None else SamplingParams(adapter=self.adapter)

    @abstractmethod
    def required_seq_len(self, tokenizer: AutoTokenizer) -> int:
        """Context the engine needs for this suite (longest input plus generated tokens); also
        where a suite checks its items against the tokenizer, before the model is loaded."""

    @abstractmethod
    def run(self, engine: InferenceEngine, *, progress: bool = False) -> SuiteResult:
        """Score every item on `engine` and return the metrics and samples."""

    def sampling_params(
        self, max_tokens: int, temperature: float, top_p: float, top_k: int
    ) -> SamplingParams:
        """A generating suite's settings from its config values, as the engine's request
        type, checked now: a bad value fails when the suite is built, before any model is
        loaded, naming the suite and the field."""
        params = SamplingParams(
            max_tokens=int(max_tokens),
            temperature=float(temperature),
            top_p=float(top_p),
            top_k=int(top_k),
        )
        try:
            return params.validate()
        except ValueError as err:
            raise ValueError(f"{self.name}: {err}") from None

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r})"


def progress_bar(total: int, desc: str, progress: bool, unit: str = "it") -> tqdm:
    """A tqdm bar when `progress` and stderr is a terminal (tqdm's `disable=None`)."""
    return tqdm(total=total, desc=desc, unit=unit, disable=None if progress else True)
