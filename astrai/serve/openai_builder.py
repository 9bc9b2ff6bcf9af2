"""OpenAI chat completions: `/v1/chat/completions`, plain and streaming."""

from __future__ import annotations

import math
from typing import Any

from astrai.serve.best_of import check_best_of
from astrai.serve.errors import APIError, openai_error_body
from astrai.serve.logprobs import chat_entries, token_text
from astrai.serve.protocol import Choice, Prepared, RequestContext, ResponseBuilder, sse
from astrai.serve.reasoning import (
    ReasoningDelta,
    after_reasoning,
    reasoning_for,
    reasoning_tokens,
)
from astrai.serve.request import openai_params, or_default, render_prompt, stop_strings
from astrai.serve.schemas import ChatCompletionRequest, ChatMessage, NamedToolChoice, given
from astrai.serve.settings import ServeSettings
from astrai.serve.structured import response_format_constraint, tool_call_constraint
from astrai.serve.structured_outputs import conflict, structured_outputs_constraint
from astrai.serve.tool_parsers import Event, TextDelta, argument_fragments
from astrai.tokenizer import AutoTokenizer

_FINISH = {
    "stop": "stop",
    "stop_sequence": "stop",
    "length": "length",
    "tool_calls": "tool_calls",
    "error": "stop",
}


def _content(m: ChatMessage) -> str | None:
    if isinstance(m.content, list):
        return "".join(p.text for p in m.content)
    return m.content


def _message(m: ChatMessage) -> dict[str, Any]:
    out: dict[str, Any] = {
        "role": "system" if m.role == "developer" else m.role,
        "content": _content(m),
    }
    if m.tool_calls:
        out["tool_calls"] = [
            {
                "id": c.id,
                "type": "function",
                "function": {"name": c.function.name, "arguments": c.function.arguments},
            }
            for c in m.tool_calls
        ]
    if m.tool_call_id is not None:
        out["tool_call_id"] = m.tool_call_id
    return out


def usage(ctx: RequestContext) -> dict[str, Any]:
    out: dict[str, Any] = {
        "prompt_tokens": ctx.prompt_tokens,
        "completion_tokens": ctx.completion_tokens,
        "total_tokens": ctx.prompt_tokens + ctx.completion_tokens,
    }
    if ctx.prepared.reasoning is not None:  # a reasoning parser split the thinking off
        thinking = sum(reasoning_tokens(c) for c in ctx.choices)
        out["completion_tokens_details"] = {"reasoning_tokens": thinking}
    return out


def top_logprobs(body: ChatCompletionRequest) -> int | None:
    """How many alternatives per token the request wants (None: no log-probs at all)."""
    if body.top_logprobs is not None and not body.logprobs:
        raise APIError(
            400,
            "top_logprobs: requires logprobs to be true",
            param="top_logprobs",
        )
    return (body.top_logprobs or 0) if body.logprobs else None


class OpenAIStyleBuilder(ResponseBuilder):
    """What OpenAI's endpoints share: the error body and the SSE chunk frame and ending."""

    chunk_object: str = "chat.completion.chunk"

    def error_body(self, err: APIError) -> dict[str, Any]:
        return openai_error_body(err)

    @staticmethod
    def head(ctx: RequestContext, obj: str) -> dict[str, Any]:
        """The fields every response and chunk starts with (`system_fingerprint` when set)."""
        out: dict[str, Any] = {
            "id": ctx.id,
            "object": obj,
            "created": ctx.created,
            "model": ctx.model,
        }
        if ctx.system_fingerprint is not None:
            out["system_fingerprint"] = ctx.system_fingerprint
        return out

    def _chunk(
        self, ctx: RequestContext, choices: list[dict[str, Any]], usage: dict | None = None
    ) -> str:
        """One chunk. With `stream_options.include_usage` every chunk has a `usage` field,
        null except on the final one (OpenAI's documented shape); without it none has one.
        Usage is sent once, so clients that add up the chunks' usage (LangChain) count it
        once."""
        data: dict[str, Any] = {**self.head(ctx, self.chunk_object), "choices": choices}
        if ctx.prepared.include_usage:
            data["usage"] = usage
        return sse(data)

    def format_stream_end(self, ctx: RequestContext) -> list[str]:
        out = [self._chunk(ctx, [], usage(ctx))] if ctx.prepared.include_usage else []
        return [*out, sse("[DONE]")]

    def format_stream_error(self, ctx: RequestContext, err: APIError) -> list[str]:
        return [sse(self.error_body(err)), sse("[DONE]")]


class OpenAIResponseBuilder(OpenAIStyleBuilder):
    id_prefix = "chatcmpl-"
    tool_id_prefix = "call_"

    def prepare(
        self, body: ChatCompletionRequest, tokenizer: AutoTokenizer, settings: ServeSettings
    ) -> Prepared:
        top = top_logprobs(body)
        best_of = check_best_of(body.best_of, or_default(body, "n"), stream=bool(body.stream))
        tools = None
        choice = body.tool_choice
        if body.tools and choice != "none":
            tools = [t.model_dump(exclude_none=True) for t in body.tools]
        if isinstance(choice, NamedToolChoice):  # render only that tool: the model sees no other
            name = choice.function.get("name")
            tools = [t for t in tools or [] if t["function"]["name"] == name]
            if not tools:
                raise APIError(
                    400, f"tool_choice names an unknown function {name!r}", param="tool_choice"
                )
        if choice == "required" and not body.tools:
            raise APIError(400, "tool_choice: required needs tools", param="tool_choice")
        kwargs = body.chat_template_kwargs
        if body.reasoning_effort is not None:  # as vLLM hands it to GPT-OSS's template
            kwargs = {**(kwargs or {}), "reasoning_effort": body.reasoning_effort}
        messages = [_message(m) for m in body.messages]
        prompt_ids = render_prompt(
            tokenizer, messages, tools, kwargs, add_generation_prompt=body.add_generation_prompt
        )
        thinking = (kwargs or {}).get("enable_thinking", True) is not False
        reasoning = reasoning_for(
            settings.reasoning_parser, tokenizer, prompt_ids, enabled=thinking
        )
        extra: dict[str, Any] = {} if top is None else {"logprobs": top}
        if reasoning is not None:  # harmony: its markers kept in the text, its stop tokens
            extra.update(reasoning.sampling_fields(tokenizer))
        structured = response_format_constraint(body.response_format, tokenizer)
        if tools and (choice == "required" or isinstance(choice, NamedToolChoice)):
            functions = [t["function"] for t in tools]
            structured = tool_call_constraint(functions, settings, tokenizer)
            if body.structured_outputs is not None:
                raise conflict("tool_choice")
        if body.structured_outputs is not None:  # vLLM's field (structured_outputs.py)
            if structured is not None:
                raise conflict("response_format")
            structured = structured_outputs_constraint(body.structured_outputs, tokenizer)
        structured = after_reasoning(structured, reasoning, tokenizer)  # after the thinking
        if structured is not None:  # compiled already: a bad schema was a 400 naming it
            extra["structured"] = structured
        field = given(body, "max_completion_tokens", "max_tokens")
        params = openai_params(
            body,
            settings,
            max_tokens=body.max_completion_tokens or or_default(body, "max_tokens"),
            max_tokens_param=field,
            **extra,
        )
        return Prepared(
            prompts=[prompt_ids],
            params=params,
            max_tokens_param=field,
            n=or_default(body, "n"),
            best_of=best_of,
            stops=stop_strings(body.stop),
            parse_tools=tools is not None,
            tool_defs=[t["function"] for t in tools] if tools else None,
            stream=bool(body.stream),
            include_usage=bool(body.stream_options and body.stream_options.include_usage),
            model=settings.model_name,  # the id /v1/models lists, whatever was asked
            options={"tokens": token_text(tokenizer) if top is not None else None},
            reasoning=reasoning,
        )

    # ------------------------------------------------------------------ streaming
    def format_stream_start(self, ctx: RequestContext) -> list[str]:
        return [
            self._chunk(
                ctx,
                [
                    {
                        "index": c.index,
                        "delta": {"role": "assistant", "content": ""},
                        "finish_reason": None,
                    }
                    for c in ctx.choices
                ],
            )
        ]

    def _logprobs(self, ctx: RequestContext, choice: Choice, upto: int | None) -> dict | None:
        """`{"content": [...], "refusal": None}` for the tokens not yet sent, through `upto`."""
        tokens = ctx.prepared.options.get("tokens")
        if tokens is None:
            return None
        task = choice.result.task
        span = choice.take_tokens(upto)
        tops = task.top_logprobs
        # Tokens a structured output's mask forbids (log-prob -inf) are no alternatives.
        entries = chat_entries(
            tokens,
            task.output_ids[span.start : span.stop],
            task.logprobs[span.start : span.stop],
            [[(t, v) for t, v in tops[k] if v != -math.inf] if k < len(tops) else () for k in span],
        )
        return {"content": entries, "refusal": None}

    def format_chunk(self, ctx: RequestContext, choice: Choice, event: Event) -> list[str]:
        i = choice.index
        if isinstance(event, ReasoningDelta):  # vLLM's field for the thinking
            delta = {"reasoning_content": event.text}
            return [self._chunk(ctx, [{"index": i, "delta": delta, "finish_reason": None}])]
        if isinstance(event, TextDelta):
            delta = {"content": event.text}
            part = {"index": i, "delta": delta, "finish_reason": None}
            logprobs = self._logprobs(ctx, choice, choice.tokens_emitted())
            if logprobs is not None:
                part["logprobs"] = logprobs
            return [self._chunk(ctx, [part])]
        head = {
            "index": event.index,
            "id": event.id,
            "type": "function",
            "function": {"name": event.name, "arguments": ""},
        }
        # Then the arguments in fragments, as OpenAI streams them (a call is sent once it
        # parsed, so the fragments always concatenate to valid JSON).
        args = [
            {"index": event.index, "function": {"arguments": piece}}
            for piece in argument_fragments(event.arguments)
        ]
        return [
            self._chunk(ctx, [{"index": i, "delta": {"tool_calls": [d]}, "finish_reason": None}])
            for d in (head, *args)
        ]

    def format_choice_end(self, ctx: RequestContext, choice: Choice) -> list[str]:
        end = {"index": choice.index, "delta": {}, "finish_reason": _FINISH[choice.finish_reason]}
        logprobs = self._logprobs(ctx, choice, None)  # whatever is left, e.g. the end token
        if logprobs is not None:
            end["logprobs"] = logprobs
        return [self._chunk(ctx, [end])]  # the usage comes once, in its own final chunk

    # ------------------------------------------------------------------ plain
    def format_response(self, ctx: RequestContext) -> dict[str, Any]:
        choices = []
        for c in ctx.choices:
            message: dict[str, Any] = {"role": "assistant", "content": c.content}
            if ctx.prepared.reasoning is not None:
                message["reasoning_content"] = c.reasoning_content or None
            if c.tool_calls:
                message["content"] = c.content or None
                message["tool_calls"] = [
                    {
                        "id": t.id,
                        "type": "function",
                        "function": {"name": t.name, "arguments": t.arguments},
                    }
                    for t in c.tool_calls
                ]
            choices.append(
                {
                    "index": c.index,
                    "message": message,
                    "logprobs": self._logprobs(ctx, c, None),
                    "finish_reason": _FINISH[c.finish_reason or "stop"],
                }
            )
        return {**self.head(ctx, "chat.completion"), "choices": choices, "usage": usage(ctx)}
