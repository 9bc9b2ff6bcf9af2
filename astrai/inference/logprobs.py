"""Log-probs beyond the sampled token: prompt scoring during prefill, top-k alternatives.

Prompt log-probs (vLLM's `prompt_logprobs`) come out of the prefill forward itself: the
logits at prompt position p score prompt token p + 1, so a prefill chunk over positions
`[a, a + n)` scores tokens `a + 1 .. a + n` (its last position scores the first token of
the next chunk, which is already known). `InferenceEngine.score` is built on it: a
continuation's log-likelihood given a context is the sum of its prompt log-probs.
This module holds the types; the tensor work is in `scoring.py`, the request's checks
(`logprobs`, `prompt_logprobs` <= `MAX_LOGPROBS`) in `params.py`.
"""

from __future__ import annotations

from dataclasses import dataclass

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


# ---------------------------------------------------------------------- during a step
@dataclass(slots=True)
class PromptScores:
    """Log-probs of prompt tokens `first, first + 1, ...` of plan row `row` (one step)."""

    row: int
    first: int
    tokens: list[TokenLogprob]
