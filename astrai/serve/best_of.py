"""`best_of` (legacy `/v1/completions`, OpenAI's and vLLM's meaning): sample `best_of`
sequences per prompt and answer the `n` with the highest cumulative log-prob.

All `best_of` samples of a prompt are one engine group (the prompt is prefilled once), seeded
like `n` choices; once every sample has ended, `keep_best` keeps each prompt's `n` most
likely, most likely first (vLLM's order), numbered `prompt_index * n + rank` as plain `n`
choices are. A sample's cumulative log-prob is the sum of the log-probs the engine recorded
for the tokens the answer reports (a stop string's trailing tokens are not the answer's).
The choice can only be made at the end, so `best_of > n` cannot stream (OpenAI refuses
it too); usage counts the returned choices' tokens, as vLLM's does.
"""

from __future__ import annotations

from astrai.serve.errors import APIError
from astrai.serve.protocol import Choice, RequestContext


def check_best_of(best_of: int | None, n: int, *, stream: bool) -> int | None:
    """`best_of` as the request may have it: at least `n`; more than `n` only unstreamed."""
    if best_of is None or best_of == n:
        return None
    if best_of < n:
        raise APIError(
            400, f"best_of: must be at least n (got best_of={best_of}, n={n})", param="best_of"
        )
    if stream:
        raise APIError(
            400, "best_of: cannot stream when best_of is greater than n", param="best_of"
        )
    return best_of


def cumulative_logprob(choice: Choice) -> float:
    """Sum of the log-probs of the tokens the choice answers with."""
    task = choice.result.task
    end = len(task.output_ids) if choice.token_end is None else choice.token_end
    return sum(task.logprobs[:end])


def keep_best(ctx: RequestContext) -> None:
    """Keep each prompt's `n` most likely samples (a no-op unless `best_of > n`)."""
    p = ctx.prepared
    if p.best_of is None or p.best_of <= p.n:
        return
    kept: list[Choice] = []
    for prompt in range(len(p.prompts)):
        samples = [c for c in ctx.choices if c.prompt_index == prompt]
        ranked = sorted(samples, key=cumulative_logprob, reverse=True)[: p.n]
        for rank, choice in enumerate(ranked):
            choice.index = prompt * p.n + rank
        kept += ranked
    ctx.choices = kept
