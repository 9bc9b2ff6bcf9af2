"""From a request body to what the engine takes: prompt ids and one `SamplingParams`.

The protocols' defaults are applied here once, for every builder: a field sent as null
takes its schema default (`schemas.py`: chat and Anthropic `top_k` 50, completions 0),
`top_p` 0 means greedy (only the most likely token survives), empty stop strings are
dropped, and an explicit `max_tokens` is held to the context by the server's
`max_tokens_policy` while a default one is capped to what fits. `openai_params` serves
both OpenAI endpoints, `anthropic_params` the Messages API; the engine checks the result.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel

from astrai.inference import SamplingParams
from astrai.serve.errors import APIError
from astrai.serve.schemas import ChatCompletionRequest, CompletionRequest, MessagesRequest
from astrai.serve.settings import ServeSettings
from astrai.tokenizer import AutoTokenizer

_RESERVED = ("messages", "tools", "add_generation_prompt", "tokenize")


def render_prompt(
    tokenizer: AutoTokenizer,
    messages: list[dict[str, Any]],
    tools: list[dict] | None,
    extra: dict[str, Any] | None = None,
    *,
    add_generation_prompt: bool = True,
) -> list[int]:
    """Chat template -> ids; template failures are the client's input, so a 400. `extra`:
    more template variables (`chat_template_kwargs`, e.g. `enable_thinking`);
    `add_generation_prompt` false (vLLM's option) leaves the assistant's header out."""
    clash = sorted(set(extra or ()) & set(_RESERVED))
    if clash:
        raise APIError(
            400,
            f"chat_template_kwargs: cannot set {', '.join(clash)}",
            param="chat_template_kwargs",
        )
    try:
        ids = tokenizer.apply_chat_template(
            messages,
            tools=tools,
            add_generation_prompt=add_generation_prompt,
            tokenize=True,
            **(extra or {}),
        )
    except (ValueError, TypeError) as err:
        raise APIError(400, f"cannot render the conversation: {err}", param="messages") from err
    assert isinstance(ids, list)
    return ids


def stop_strings(stop: str | list[str] | None) -> list[str]:
    """`stop` / `stop_sequences` as a list, without empty strings (they would match at once)."""
    stops = [stop] if isinstance(stop, str) else list(stop or [])
    return [s for s in stops if s]


def or_default(body: BaseModel, name: str) -> Any:
    """`body.<name>`, or its schema default when the request sent null."""
    got = getattr(body, name)
    return type(body).model_fields[name].default if got is None else got


def openai_params(
    body: ChatCompletionRequest | CompletionRequest,
    settings: ServeSettings,
    *,
    max_tokens: int,
    max_tokens_param: str | None,
    **extra: Any,
) -> SamplingParams:
    """The settings of an OpenAI request (chat or legacy completions); `extra`: the
    endpoint's own (log-probs, a structured-output constraint)."""
    return _params(
        body,
        settings,
        max_tokens=max_tokens,
        max_tokens_param=max_tokens_param,
        min_p=or_default(body, "min_p"),
        presence_penalty=or_default(body, "presence_penalty"),
        frequency_penalty=or_default(body, "frequency_penalty"),
        logit_bias=body.logit_bias or None,
        seed=body.seed,
        priority=or_default(body, "priority"),
        **extra,
    )


def anthropic_params(
    body: MessagesRequest, settings: ServeSettings, *, max_tokens_param: str | None, **extra: Any
) -> SamplingParams:
    """The settings of an Anthropic Messages request (it has no penalties, bias or seed)."""
    extra["priority"] = or_default(body, "priority")  # vLLM's extra field, as OpenAI's
    return _params(
        body, settings, max_tokens=body.max_tokens, max_tokens_param=max_tokens_param, **extra
    )


def _params(
    body: BaseModel,
    settings: ServeSettings,
    *,
    max_tokens: int,
    max_tokens_param: str | None,
    **rest: Any,
) -> SamplingParams:
    """What every protocol shares: temperature, top_p (0: greedy), top_k, max_tokens."""
    temperature, top_p = or_default(body, "temperature"), or_default(body, "top_p")
    if top_p == 0:  # only the most likely token survives: greedy
        temperature, top_p = 0.0, 1.0
    return SamplingParams(
        temperature=temperature,
        top_p=top_p,
        top_k=or_default(body, "top_k"),
        max_tokens=max_tokens,
        # Explicit: held to the context (the engine's rule, by the server's policy); a
        # default is capped to what fits: the engine stops at a full context.
        max_tokens_policy=settings.max_tokens_policy if max_tokens_param else "clamp",
        **rest,
    )
