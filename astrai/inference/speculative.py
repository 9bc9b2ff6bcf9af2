"""Speculative decoding: the setting, the n-gram proposer, budgets and figures.

vLLM's `speculative_config` names: `method` (``ngram``: prompt lookup over the request's own
prompt and output; ``draft_model``: a smaller model sharing the tokenizer, greedy), at most
`num_speculative_tokens` (K) proposals per request per step, `prompt_lookup_min` /
`prompt_lookup_max` (the n-gram sizes tried, longest first), `model` (the draft model's
directory).

One step: the scheduler gives each decoding request a budget (K, less near `max_tokens` or
the end of the context, 0 while it backs off) and reserves KV for it; the runner asks the
proposer (`astrai.inference.proposers`) for up to that many tokens, feeds the request's
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
import weakref
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from astrai.inference.params import check_choice, is_int

if TYPE_CHECKING:
    from astrai.inference.task import Task

SPEC_METHODS = ("ngram", "draft_model")
MAX_SPECULATIVE_TOKENS = 16
# Backing off: after `n` verifications in a row that accepted nothing, a request skips
# speculation for 2**n - 1 steps (at most MAX_SKIP), so a workload where proposals fail
# decodes as without speculation, bar the proposals' lookups.
MAX_SKIP = 31


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
    """Proposes each decoding request's next tokens (deterministically)."""

    @abstractmethod
    def propose(self, tasks: Sequence[Task], budgets: Sequence[int]) -> list[list[int]]:
        """Up to `budgets[i]` tokens to follow `tasks[i]`'s prompt + output."""

    def verified(self, task: Task, proposed: int, accepted: int) -> None:  # noqa: B027
        """`accepted` of `task`'s `proposed` tokens were kept (a draft model's KV follows)."""

    def close(self) -> None:  # noqa: B027
        """Free what the proposer holds (the engine stops)."""


class NgramIndex:
    """One request's n-grams (sizes `lo..hi`) -> where each first and last started, kept
    up to date as tokens arrive, so that a lookup costs a dict access per size, not a scan."""

    def __init__(self, lo: int, hi: int) -> None:
        self.lo, self.hi = lo, hi
        self.seen = 0  # tokens indexed
        self.last: dict[tuple[int, ...], int] = {}
        self.first: dict[tuple[int, ...], int] = {}

    def lookup(self, seq: Sequence[int], k: int) -> list[int]:
        """The `k` tokens after the latest earlier occurrence of the longest suffix of
        `seq` (sizes hi..lo) that occurred before (the first occurrence when that gives
        more: in a repeated run the latest runs into the suffix); [] when none did."""
        n_seq = len(seq)
        self._index(seq, n_seq - 1)  # every n-gram that ends before the suffix
        proposal: list[int] = []
        for n in range(min(self.hi, n_seq - 1), self.lo - 1, -1):
            key = tuple(seq[n_seq - n :])
            start = self.last.get(key)
            if start is None:
                continue
            proposal = list(seq[start + n : start + n + k])
            if len(proposal) < k:  # the latest match runs into the suffix (a repeated run):
                first = self.first[key]  # the first one may continue further
                proposal = max(proposal, list(seq[first + n : first + n + k]), key=len)
            if proposal:
                break
        self._index(seq, n_seq)
        return proposal

    def _index(self, seq: Sequence[int], upto: int) -> None:
        """Index the n-grams ending at positions `seen + 1 .. upto` (the suffix is indexed
        only after its lookup, so a match is always an earlier occurrence)."""
        for end in range(self.seen + 1, upto + 1):
            for n in range(self.lo, min(self.hi, end) + 1):
                key = tuple(seq[end - n : end])
                self.last[key] = end - n
                self.first.setdefault(key, end - n)
        self.seen = max(self.seen, upto)


class NgramProposer(Proposer):
    """Prompt lookup (vLLM's ``ngram``): the tokens that followed the latest earlier
    occurrence of the request's last n tokens, n from `prompt_lookup_max` down."""

    def __init__(self, config: SpeculativeConfig) -> None:
        self.lo, self.hi = config.prompt_lookup_min, config.prompt_lookup_max
        self._index: weakref.WeakKeyDictionary[Task, NgramIndex] = weakref.WeakKeyDictionary()

    def propose(self, tasks: Sequence[Task], budgets: Sequence[int]) -> list[list[int]]:
        out = []
        for task, k in zip(tasks, budgets):
            index = self._index.get(task)
            if index is None:
                index = self._index[task] = NgramIndex(self.lo, self.hi)
            out.append(index.lookup(task.prompt_ids + task.output_ids, k) if k > 0 else [])
        return out


def next_budget(task: Task, k: int, max_seq_len: int) -> int:
    """How many proposals `task` may verify this step: `k`, less near its `max_tokens` or
    the end of the context; 0 while it backs off (`MAX_SKIP`)."""
    if task.spec_skip > 0:
        task.spec_skip -= 1
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
        task.spec_proposed += proposed
        task.spec_accepted += accepted
        if not accepted:
            task.spec_misses += 1
            task.spec_skip = min((1 << task.spec_misses) - 1, MAX_SKIP)
        else:
            task.spec_misses = 0

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
    "SPEC_METHODS",
    "NgramIndex",
    "NgramProposer",
    "Proposer",
    "SpecCounters",
    "SpeculativeConfig",
    "next_budget",
]
