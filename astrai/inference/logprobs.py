"""Log-probs beyond the sampled token: prompt scoring during prefill, top-k alternatives.

Prompt log-probs (vLLM's `prompt_logprobs`) come out of the prefill forward itself: the
logits at prompt position p score prompt token p + 1, so a prefill chunk over positions
`[a, a + n)` scores tokens `a + 1 .. a + n` (its last position scores the first token of
the next chunk, which is already known). `InferenceEngine.score` is built on it: a
continuation's log-likelihood given a context is the sum of its prompt log-probs.
This module holds the types and field checks; the tensor work is in `scoring.py`.
"""

from __future__ import annotations

from dataclasses import dataclass
from numbers import Integral
from typing import Any

MAX_LOGPROBS = 20

TopLogprobs = tuple[tuple[int, float], ...]


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    """One scored token: its log-prob under the model's raw distribution, whether it is
    the argmax at its position, and the `k` most likely `(token_id, logprob)`, descending."""

    token_id: int
    logprob: float
    greedy: bool
    top: TopLogprobs = ()


@dataclass
class ScoreResult:
    """`InferenceEngine.score` output for one `(context, continuation)` request.

    `logprob` sums the continuation tokens' log-probs; `greedy` is True when every one of
    them is the argmax at its position (greedy decoding would have produced it).
    """

    logprob: float
    greedy: bool
    tokens: list[TokenLogprob]


def is_int(value: object) -> bool:
    return isinstance(value, Integral) and not isinstance(value, bool)


def check_int_fields(params: Any) -> None:
    """Validate the integer fields of a `SamplingParams`, naming the field."""
    if params.seed is not None and not is_int(params.seed):
        raise ValueError(f"seed must be an int or None, got {params.seed!r}")
    if not is_int(params.max_tokens):
        raise ValueError(f"max_tokens must be an int, got {params.max_tokens!r}")
    if not is_int(params.logprobs) or not 0 <= params.logprobs <= MAX_LOGPROBS:
        raise ValueError(f"logprobs must be an int in [0, {MAX_LOGPROBS}], got {params.logprobs!r}")
    k = params.prompt_logprobs
    if k is not None and (not is_int(k) or not 0 <= k <= MAX_LOGPROBS):
        raise ValueError(
            f"prompt_logprobs must be None or an int in [0, {MAX_LOGPROBS}], got {k!r}"
        )
    start = params.prompt_logprobs_start
    if not is_int(start) or start < 1:
        raise ValueError(f"prompt_logprobs_start must be an int >= 1, got {start!r}")


# ---------------------------------------------------------------------- during a step
@dataclass(slots=True)
class PromptScores:
    """Log-probs of prompt tokens `first, first + 1, ...` of plan row `row` (one step)."""

    row: int
    first: int
    tokens: list[TokenLogprob]
