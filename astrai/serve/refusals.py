"""The engine's refusals of a request as the protocol's errors.

The engine checks every request once (`InferenceEngine.check_request`, run by `submit`):
bad settings raise a `ValueError` that starts with the parameter's name; a request that
can never run ends at once, finish reason `rejected`, with the setting at fault
(`Rejection.param`: ``"prompt"``, ``"max_tokens"``, ...; None: the engine has failed).
Here those become 400s naming the field as this protocol spells it (`messages`, `prompt`,
`prompt[1]` in a completions batch, `max_tokens` or `max_completion_tokens`), and a
failed engine a 503. The server has no prompt check of its own.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from astrai.inference.task import Rejection
from astrai.serve.errors import APIError
from astrai.serve.protocol import Prepared, RequestContext

if TYPE_CHECKING:
    from astrai.inference import GenerateResult


def bad_settings(err: ValueError | TypeError) -> APIError:
    """A `SamplingParams.validate()` error (`top_p must be ...`, `logit_bias[5] ...`): a
    400 whose `param` is the setting its message starts with."""
    message = str(err)
    return APIError(400, message, param=message.split(" ")[0].split("[")[0])


def refused(p: Prepared, prompt: int, rejection: Rejection) -> APIError:
    """A request the engine rejected, about prompt `prompt` of `p`: a 400 naming the field at
    fault (`Rejection.param`) as this protocol spells it, `context_length_exceeded` when it
    does not fit the context; no param (the engine has failed): a 503."""
    reason, param = rejection.reason, rejection.param
    if param is None:
        return APIError(503, reason, kind="overloaded")
    where = f"{p.prompt_param}[{prompt}]" if len(p.prompts) > 1 else p.prompt_param
    code = "context_length_exceeded" if rejection.exceeds_context else None
    if param == "max_tokens":
        field = p.max_tokens_param or "max_tokens"
        prefix = f"{where}: " if len(p.prompts) > 1 else ""
        return APIError(400, f"{field}: {prefix}{reason}", param=field, code=code)
    # The prompt itself ("prompt"), or one too short to score ("prompt_logprobs_start").
    return APIError(400, f"{where}: {reason}", param=p.prompt_param, code=code)


def ended(p: Prepared, prompt: int, result: GenerateResult) -> APIError:
    """A task that ended at submission: a rejection is `refused`; an abort (the engine
    failed while it was queued) is a 503."""
    task = result.task
    reason = task.error or "request rejected"
    if result.finish_reason != "rejected":
        return APIError(503, reason, kind="overloaded")
    return refused(p, prompt, task.rejection or Rejection(reason))


def failed(ctx: RequestContext) -> APIError:
    """A plain request whose task failed after it was queued: rejected at admission (e.g. a
    paged KV pool that can never hold the prompt) is a 400 naming the prompt, else a 500."""
    if any(c.result.finish_reason == "rejected" for c in ctx.choices):
        return APIError(400, ctx.error or "request rejected", param=ctx.prepared.prompt_param)
    return APIError(500, ctx.error or "request failed", kind="server")
