"""OpenAI's Responses API: `/v1/responses`, plain and streaming, with `previous_response_id`.

The request is prepared as the chat completion it amounts to (`responses_request`), by the
chat builder itself: one prompt renderer, one tool-call parser and one reasoning parser for
both APIs. This builder only renames the fields errors name (`input`,
`max_output_tokens`) and formats the answer as a Response: `reasoning` items (the
reasoning parser's thinking), `message` items (`output_text`) and `function_call` items (the
tool-call parser's calls), streamed as OpenAI's typed events, each with its
`sequence_number`. A finished response is kept for continuations (`responses_store`)
unless the request says `store: false`.
"""

from __future__ import annotations

import secrets
from dataclasses import replace
from typing import Any

from astrai.serve.errors import APIError, openai_error_body
from astrai.serve.openai_builder import OpenAIResponseBuilder
from astrai.serve.protocol import Choice, Prepared, RequestContext, ResponseBuilder, sse
from astrai.serve.reasoning import ReasoningDelta, reasoning_tokens
from astrai.serve.responses_request import (
    ResponsesRequest,
    chat_request,
    input_messages,
    text_echo,
)
from astrai.serve.responses_store import ResponseStore, StoredResponse
from astrai.serve.settings import ServeSettings
from astrai.serve.tool_parsers import Event, TextDelta, ToolCall, argument_fragments
from astrai.tokenizer import AutoTokenizer

# The chat request's field names in errors -> this API's.
_RENAMED = {"messages": "input", "max_completion_tokens": "max_output_tokens"}


def _renamed(err: APIError) -> APIError:
    param = _RENAMED.get(err.param or "")
    if param is None and (err.param or "").startswith("response_format"):
        param = "text.format"  # `text.format` travels as the chat API's `response_format`
    if param is None:
        return err
    message = err.message
    if message.startswith(f"{err.param}:"):
        message = param + message[len(err.param or "") :]
    return APIError(err.status, message, kind=err.kind, param=param, code=err.code)


def _new_id(prefix: str) -> str:
    return prefix + secrets.token_hex(12)


def _text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _message(item_id: str, text: str, status: str = "completed") -> dict[str, Any]:
    content = [] if status == "in_progress" else [_text_part(text)]
    return {
        "type": "message",
        "id": item_id,
        "role": "assistant",
        "status": status,
        "content": content,
    }


def _reasoning(item_id: str, text: str, status: str = "completed") -> dict[str, Any]:
    content = [] if status == "in_progress" else [{"type": "reasoning_text", "text": text}]
    return {"type": "reasoning", "id": item_id, "summary": [], "content": content, "status": status}


def _function_call(call: ToolCall, status: str = "completed") -> dict[str, Any]:
    return {
        "type": "function_call",
        "id": "fc_" + call.id.removeprefix("call_"),
        "call_id": call.id,
        "name": call.name,
        "arguments": "" if status == "in_progress" else call.arguments,
        "status": status,
    }


def usage(ctx: RequestContext) -> dict[str, Any]:
    thinking = sum(reasoning_tokens(c) for c in ctx.choices)
    return {
        "input_tokens": ctx.prompt_tokens,
        "input_tokens_details": {"cached_tokens": 0},
        "output_tokens": ctx.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": thinking},
        "total_tokens": ctx.prompt_tokens + ctx.completion_tokens,
    }


def assistant_message(output: list[dict[str, Any]]) -> dict[str, Any]:
    """A response's output as the chat message a continuation's prompt renders."""
    text = "".join(
        p["text"] for item in output if item["type"] == "message" for p in item["content"]
    )
    message: dict[str, Any] = {"role": "assistant", "content": text}
    calls = [
        {
            "id": item["call_id"],
            "type": "function",
            "function": {"name": item["name"], "arguments": item["arguments"]},
        }
        for item in output
        if item["type"] == "function_call"
    ]
    if calls:
        message["tool_calls"] = calls
    return message


class ResponsesBuilder(ResponseBuilder):
    """`/v1/responses`: the chat builder's `Prepared`, formatted as Response objects."""

    id_prefix = "resp_"
    tool_id_prefix = "call_"
    prompt_fields = ("instructions", "input")

    def __init__(self, store: ResponseStore) -> None:
        self.store = store
        self.chat = OpenAIResponseBuilder()

    def prepare(
        self, body: ResponsesRequest, tokenizer: AutoTokenizer, settings: ServeSettings
    ) -> Prepared:
        history: list[dict[str, Any]] = []
        if body.previous_response_id is not None:  # a 400 naming it when not stored
            history = self.store.get(body.previous_response_id).messages
        messages = history + input_messages(body)
        try:
            prepared = self.chat.prepare(chat_request(body, messages), tokenizer, settings)
        except APIError as err:
            raise _renamed(err) from err
        echo = {
            "instructions": body.instructions,
            "max_output_tokens": body.max_output_tokens,
            "previous_response_id": body.previous_response_id,
            "temperature": body.temperature,
            "top_p": body.top_p,
            "tools": [t.model_dump() for t in body.tools or []],
            "tool_choice": body.tool_choice.model_dump()
            if not isinstance(body.tool_choice, str | None)
            else body.tool_choice or "auto",
            "parallel_tool_calls": body.parallel_tool_calls is not False,
            "metadata": body.metadata or {},
            "store": body.store is not False,
            "user": body.user,
            "text": text_echo(body),
        }
        return replace(
            prepared,
            prompt_param="input",
            max_tokens_param=_RENAMED.get(prepared.max_tokens_param or ""),
            include_usage=False,
            options={"messages": messages, "echo": echo},
        )

    def error_body(self, err: APIError) -> dict[str, Any]:
        return openai_error_body(err)

    # ------------------------------------------------------------------ the Response
    @staticmethod
    def _status(choice: Choice) -> str:
        return "incomplete" if choice.finish_reason == "length" else "completed"

    def _response(
        self,
        ctx: RequestContext,
        status: str,
        output: list[dict[str, Any]],
        with_usage: bool = True,
    ) -> dict[str, Any]:
        incomplete = {"reason": "max_output_tokens"} if status == "incomplete" else None
        return {
            "id": ctx.id,
            "object": "response",
            "created_at": ctx.created,
            "status": status,
            "model": ctx.model,
            "output": output,
            "error": None,
            "incomplete_details": incomplete,
            **ctx.prepared.options["echo"],
            "truncation": "disabled",
            "usage": usage(ctx) if with_usage else None,
        }

    def _finished(self, ctx: RequestContext, output: list[dict[str, Any]]) -> dict[str, Any]:
        """The final Response; kept for continuations unless `store` is false."""
        response = self._response(ctx, self._status(ctx.choices[0]), output)
        if response["store"]:
            messages = [*ctx.prepared.options["messages"], assistant_message(output)]
            self.store.put(ctx.id, StoredResponse(messages, response))
        return response

    def format_response(self, ctx: RequestContext) -> dict[str, Any]:
        choice = ctx.choices[0]
        output: list[dict[str, Any]] = []
        if choice.reasoning:
            output.append(_reasoning(_new_id("rs_"), choice.reasoning_content))
        if choice.content or not (choice.tool_calls or choice.reasoning):
            output.append(_message(_new_id("msg_"), choice.content))
        output += [_function_call(t) for t in choice.tool_calls]
        return self._finished(ctx, output)

    # ------------------------------------------------------------------ streaming
    def _event(self, ctx: RequestContext, kind: str, **fields: Any) -> str:
        seq = ctx.extra["seq"]
        ctx.extra["seq"] = seq + 1
        return sse({"type": kind, "sequence_number": seq, **fields}, kind)

    def format_stream_start(self, ctx: RequestContext) -> list[str]:
        # `output`: the finished items by output index; `open`: (kind, index, id) of the
        # message or reasoning item being streamed, `text` its text so far.
        ctx.extra.update(seq=0, output=[], open=None, text=[])
        head = self._response(ctx, "in_progress", [], with_usage=False)
        return [
            self._event(ctx, "response.created", response=head),
            self._event(ctx, "response.in_progress", response=head),
        ]

    def _open(self, ctx: RequestContext, kind: str) -> list[str]:
        """Open a `message` or `reasoning` item (closing another open one first)."""
        opened = ctx.extra["open"]
        if opened is not None and opened[0] == kind:
            return []
        out = self._close(ctx)
        index, item_id = len(ctx.extra["output"]), _new_id("msg_" if kind == "message" else "rs_")
        ctx.extra["open"], ctx.extra["text"] = (kind, index, item_id), []
        item = (_message if kind == "message" else _reasoning)(item_id, "", "in_progress")
        part = _text_part("") if kind == "message" else {"type": "reasoning_text", "text": ""}
        where = {"item_id": item_id, "output_index": index, "content_index": 0}
        return [
            *out,
            self._event(ctx, "response.output_item.added", output_index=index, item=item),
            self._event(ctx, "response.content_part.added", **where, part=part),
        ]

    def _close(self, ctx: RequestContext) -> list[str]:
        opened = ctx.extra["open"]
        if opened is None:
            return []
        kind, index, item_id = opened
        text = "".join(ctx.extra["text"])
        ctx.extra["open"] = None
        where = {"item_id": item_id, "output_index": index, "content_index": 0}
        if kind == "message":
            item = _message(item_id, text)
            done = self._event(ctx, "response.output_text.done", **where, text=text, logprobs=[])
        else:
            item = _reasoning(item_id, text)
            done = self._event(ctx, "response.reasoning_text.done", **where, text=text)
        ctx.extra["output"].append(item)
        return [
            done,
            self._event(ctx, "response.content_part.done", **where, part=item["content"][0]),
            self._event(ctx, "response.output_item.done", output_index=index, item=item),
        ]

    def format_chunk(self, ctx: RequestContext, choice: Choice, event: Event) -> list[str]:
        if isinstance(event, ReasoningDelta | TextDelta):
            kind = "message" if isinstance(event, TextDelta) else "reasoning"
            out = self._open(ctx, kind)
            _, index, item_id = ctx.extra["open"]
            ctx.extra["text"].append(event.text)
            where = {"item_id": item_id, "output_index": index, "content_index": 0}
            if kind == "message":
                delta = self._event(
                    ctx, "response.output_text.delta", **where, delta=event.text, logprobs=[]
                )
            else:
                delta = self._event(ctx, "response.reasoning_text.delta", **where, delta=event.text)
            return [*out, delta]
        out = self._close(ctx)
        index, item = len(ctx.extra["output"]), _function_call(event)
        where = {"item_id": item["id"], "output_index": index}
        added = _function_call(event, "in_progress")
        out.append(self._event(ctx, "response.output_item.added", output_index=index, item=added))
        out += [
            self._event(ctx, "response.function_call_arguments.delta", **where, delta=piece)
            for piece in argument_fragments(event.arguments)
        ]
        out.append(
            self._event(
                ctx, "response.function_call_arguments.done", **where, arguments=event.arguments
            )
        )
        out.append(self._event(ctx, "response.output_item.done", output_index=index, item=item))
        ctx.extra["output"].append(item)
        return out

    def format_choice_end(self, ctx: RequestContext, choice: Choice) -> list[str]:
        out = self._close(ctx)
        if not ctx.extra["output"]:  # always at least one (empty) message
            out += self._open(ctx, "message") + self._close(ctx)
        return out

    def format_stream_end(self, ctx: RequestContext) -> list[str]:
        response = self._finished(ctx, ctx.extra["output"])
        kind = f"response.{response['status']}"  # response.completed / response.incomplete
        return [self._event(ctx, kind, response=response)]

    def format_stream_error(self, ctx: RequestContext, err: APIError) -> list[str]:
        response = self._response(ctx, "failed", ctx.extra["output"])
        response["error"] = {"code": "server_error", "message": err.message}
        return [self._event(ctx, "response.failed", response=response)]
