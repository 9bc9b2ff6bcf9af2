"""Speculative decoding's ``ngram`` proposer: prompt lookup over the request's own tokens
(pure Python; the setting and the interface: `astrai.inference.speculative`)."""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import TYPE_CHECKING

from astrai.inference.speculative import Proposer, SpeculativeConfig

if TYPE_CHECKING:
    from astrai.inference.task import Task


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
        self.num_speculative_tokens = config.num_speculative_tokens
        self._index: weakref.WeakKeyDictionary[Task, NgramIndex] = weakref.WeakKeyDictionary()

    def propose(self, tasks: Sequence[Task], budgets: Sequence[int]) -> list[list[int]]:
        out = []
        for task, k in zip(tasks, budgets):
            index = self._index.get(task)
            if index is None:
                index = self._index[task] = NgramIndex(self.lo, self.hi)
            out.append(index.lookup(task.prompt_ids + task.output_ids, k) if k > 0 else [])
        return out


__all__ = ["NgramIndex", "NgramProposer"]
