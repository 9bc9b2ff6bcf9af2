"""The one prompt check every caller goes through: can a request ever run on this engine?

The HTTP server, batch generation, evaluation and offline use all reach it through
`InferenceScheduler.problem`, so what is refused, and the words of the refusal, cannot
differ between them.
"""

from __future__ import annotations

from collections.abc import Sequence

from astrai.inference.params import SamplingParams
from astrai.inference.task import Rejection


def prompt_problem(
    prompt_ids: Sequence[int],
    params: SamplingParams,
    *,
    vocab_size: int,
    max_seq_len: int,
    max_prompt_tokens: int | None,
    failure: str | None = None,
) -> Rejection | None:
    """Why a request with valid `params` can never run (None: it can).

    `param` tags the setting at fault, for callers that answer in their own field names:
    ``"prompt"`` (empty, longer than the context or than `max_prompt_tokens`, ids outside
    the vocabulary), ``"max_tokens"`` (not positive; or, with `max_tokens_policy="error"`,
    prompt + `max_tokens` beyond the context: with "clamp" generation stops when the context
    is full), ``"prompt_logprobs_start"`` (nothing left to score); None: the engine has
    failed (`failure`).
    """
    n = len(prompt_ids)
    if not n:
        return Rejection("empty prompt", param="prompt")
    scoring = params.prompt_logprobs is not None
    if params.max_tokens < 0 or (params.max_tokens == 0 and not scoring):
        return Rejection(
            f"max_tokens must be positive (0 only with prompt_logprobs), got {params.max_tokens}",
            param="max_tokens",
        )
    too_long = _too_long(n, params.max_tokens, max_seq_len, max_prompt_tokens)
    if too_long is not None:
        return Rejection(too_long, param="prompt", exceeds_context=True)
    if scoring and params.prompt_logprobs_start >= n:
        return Rejection(
            f"prompt_logprobs_start ({params.prompt_logprobs_start}) must be below the "
            f"prompt length ({n}): nothing would be scored",
            param="prompt_logprobs_start",
        )
    bad = [i for i in prompt_ids if not 0 <= i < vocab_size]
    if bad:
        return Rejection(
            f"token id(s) outside the vocabulary [0, {vocab_size}): {bad[:5]}", param="prompt"
        )
    total = n + params.max_tokens
    if params.max_tokens_policy == "error" and total > max_seq_len:
        return Rejection(
            f"this model's maximum context length is {max_seq_len} tokens, but "
            f"{total} were requested ({n} in the prompt + {params.max_tokens} to "
            f"generate); at most {max_seq_len - n} can be generated after this prompt",
            param="max_tokens",
            exceeds_context=True,
        )
    if failure is not None:
        return Rejection(f"engine not ready: {failure}")
    return None


def _too_long(n: int, max_tokens: int, max_seq_len: int, cap: int | None) -> str | None:
    """The context holds the prompt plus at least one generated token (unless
    max_tokens=0: scoring); `max_prompt_tokens` may cap prompts below that."""
    room = max_seq_len - min(max_tokens, 1)
    limit = room if cap is None else min(room, cap)
    if n <= limit:
        return None
    why = (
        "max_prompt_tokens"
        if limit < room
        else f"the context holds {max_seq_len}: the prompt + at least one generated "
        "token, unless max_tokens=0"
    )
    return f"prompt is too long: {n} tokens, the limit is {limit} ({why})"
