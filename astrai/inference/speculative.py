"""Speculative decoding: the setting, the proposer interface, budgets and figures.

vLLM's `speculative_config` names: `method` (``ngram``: prompt lookup over the request's own
prompt and output; ``draft_model``: a smaller model sharing the tokenizer, greedy), at most
`num_speculative_tokens` (K) proposals per request per step, `prompt_lookup_min` /
`prompt_lookup_max` (the n-gram sizes tried, longest first), `model` (the draft model's
directory).

One step: the scheduler gives each decoding request a budget (K, less near `max_tokens` or
the end of the context, 0 while it backs off) and reserves KV for it; the runner asks the
proposer (`InferenceEngine.proposer`) for up to that many tokens, feeds the request's
newest token plus its proposals as one ragged extend row (`verify.with_drafts`: the
chunked-prefill path), and verifies them (`astrai.inference.verify`). Both proposers are
deterministic, so verification is "sample and compare": position j is sampled from the
target's own distribution with the request's own generator, exactly as without speculation,
and the proposal is accepted while it equals the sample. The first sample that differs is emitted in place of the proposal and ends the
row; when all are accepted, the sample after the last proposal is a bonus token. For a
one-hot proposal this is the rejection sampler of Leviathan et al. (accept with
probability p(x), else draw from the residual p without x) with the randomness shared, so
the output keeps the target distribution and a seeded request writes the same text with
speculation on and off: each emitted token costs the request's stream one draw, as without.
"""

from __future__ import annotations

import dataclasses
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from astrai.inference.params import check_choice, is_int

if TYPE_CHECKING:
    from astrai.inference.cache import PagePool
    from astrai.inference.task import Task

SPEC_METHODS = ("ngram", "draft_model")
MAX_SPECULATIVE_TOKENS = 16


@dataclass
class SpeculativeConfig:
    """`engine.speculative`: see the module docstring."""

    method: str = "ngram"
    num_speculative_tokens: int = 4
    prompt_lookup_min: int = 1
    prompt_lookup_max: int = 4
    model: str | None = None

    def __post_init__(self) -> None:
        check_choice("engine.speculative.method", self.method, SPEC_METHODS)
        k = self.num_speculative_tokens
        if not is_int(k) or not 1 <= k <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(
                f"engine.speculative.num_speculative_tokens must be an int in "
                f"[1, {MAX_SPECULATIVE_TOKENS}], got {k!r}"
            )
        lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
        if not (is_int(lo) and is_int(hi) and 1 <= lo <= hi):
            raise ValueError(
                "engine.speculative.prompt_lookup_min / prompt_lookup_max must be ints with "
                f"1 <= min <= max, got {lo!r} / {hi!r}"
            )
        if self.method == "draft_model" and not self.model:
            raise ValueError("engine.speculative.model: method draft_model needs a model dir")

    @classmethod
    def of(cls, value: SpeculativeConfig | Mapping[str, Any] | None) -> SpeculativeConfig | None:
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if not isinstance(value, Mapping):
            raise ValueError(f"engine.speculative must be a mapping or null, got {value!r}")
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(value) - names)
        if unknown:
            raise ValueError(
                f"engine.speculative: unknown key(s) {unknown}; expected {sorted(names)}"
            )
        return cls(**dict(value))


class Proposer(ABC):
    """Proposes each decoding request's next tokens (deterministically), at most
    `num_speculative_tokens` (K) per request and step."""

    num_speculative_tokens: int

    @abstractmethod
    def propose(self, tasks: Sequence[Task], budgets: Sequence[int]) -> list[list[int]]:
        """Up to `budgets[i]` tokens to follow `tasks[i]`'s prompt + output."""

    def verified(self, task: Task, proposed: int, accepted: int) -> None:  # noqa: B027
        """`accepted` of `task`'s `proposed` tokens were kept (a draft model's KV follows)."""

    def close(self) -> None:  # noqa: B027
        """Free what the proposer holds (the engine stops)."""

    @property
    def kv_pools(self) -> tuple[PagePool, ...]:
        """The KV pools the proposer holds (a draft model's), which the engine's sleep frees."""
        return ()


class NoProposer(Proposer):
    """Speculation off (K = 0), as `NoPrefixCache` is the prefix cache that shares nothing:
    no request ever gets a proposal budget, so nothing is proposed or verified."""

    num_speculative_tokens = 0

    def propose(self, tasks: Sequence[Task], budgets: Sequence[int]) -> list[list[int]]:
        return [[] for _ in tasks]


NO_PROPOSER = NoProposer()  # stateless: one serves every engine without speculation


def next_budget(task: Task, k: int, max_seq_len: int) -> int:
    """How many proposals `task` may verify this step: `k`, less near its `max_tokens` or
    the end of the context; 0 while it backs off (`MAX_SKIP`)."""
    spec = task.spec
    if spec.skip > 0:
        spec.skip -= 1
        return 0
    room = min(task.params.max_tokens - len(task.output_ids) - 1, max_seq_len - task.total_len)
    return max(0, min(k, room))


@dataclass
class SpecCounters:
    """The engine's speculative-decoding figures (vLLM's): verifications with proposals,
    tokens proposed and accepted; `record` also keeps each request's own and its back-off."""

    enabled: bool = False
    drafts: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0

    def record(self, task: Task, proposed: int, accepted: int) -> None:
        self.drafts += 1
        self.draft_tokens += proposed
        self.accepted_tokens += accepted
        task.spec.record(proposed, accepted)

    def stats(self) -> dict[str, Any]:
        """For `get_stats` (none while speculation is off); the mean accepted length is
        1 + accepted per verification: the tokens a request gains per step."""
        if not self.enabled:
            return {}
        drafts = self.drafts
        return {
            "spec_num_drafts": drafts,
            "spec_draft_tokens": self.draft_tokens,
            "spec_accepted_tokens": self.accepted_tokens,
            "spec_mean_accepted_length": 1 + self.accepted_tokens / drafts if drafts else 0.0,
        }


__all__ = [
    "NO_PROPOSER",
    "SPEC_METHODS",
    "NoProposer",
    "Proposer",
    "SpecCounters",
    "SpeculativeConfig",
    "next_budget",
]
