"""Anthropic messages: `/v1/messages`, plain and streaming (content blocks)."""

from __future__ import annotations

from typing import Any

from astrai.serve.errors import APIError, anthropic_error_body
from astrai.serve.protocol import Choice, Prepared, RequestContext, ResponseBuilder, sse
from astrai.serve.reasoning import (
    ReasoningDelta,
    after_reasoning,
    check_reasoning_parser,
    reasoning_for,
    thinking_budget,
)
from astrai.serve.request import anthropic_params, render_prompt, stop_strings
from astrai.serve.schemas import (
    AnthropicMessage,
    AnthropicText,
    AnthropicToolResult,
    AnthropicToolUse,
    MessagesRequest,
    given,
)
from astrai.serve.settings import ServeSettings
from astrai.serve.structured import tool_call_constraint
from astrai.serve.tool_parsers import Event, TextDelta, argument_fragments
from astrai.tokenizer import AutoTokenizer

_STOP = {
    "stop": "end_turn",
    "stop_sequence": "stop_sequence",
    "length": "max_tokens",
    "tool_calls": "tool_use",
    "error": "end_turn",
}


def _text(content: str | list[AnthropicText] | None) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "".join(b.text for b in content)


def _messages(m: AnthropicMessage) -> list[dict[str, Any]]:
    """One Anthropic message -> chat-template messages (tool results become `tool` turns)."""
    if isinstance(m.content, str):
        return [{"role": m.role, "content": m.content}]
    texts = [b.text for b in m.content if isinstance(b, AnthropicText)]
    if m.role == "assistant":
        calls = [
            {"id": b.id, "type": "function", "function": {"name": b.name, "arguments": b.input}}
            for b in m.content
            if isinstance(b, AnthropicToolUse)
        ]
        msg: dict[str, Any] = {"role": "assistant", "content": "".join(texts)}
        if calls:
            msg["tool_calls"] = calls
        return [msg]
    out: list[dict[str, Any]] = [
        {"role": "tool", "content": _text(b.content), "tool_call_id": b.tool_use_id}
        for b in m.content
        if isinstance(b, AnthropicToolResult)
    ]
    if texts or not out:
        out.append({"role": "user", "content": "".join(texts)})
    return out


def _thinking(body: MessagesRequest) -> tuple[bool, int | None]:
    """`thinking` -> (enabled, budget_tokens); budget_tokens is required when enabled and
    must be less than `max_tokens` (Anthropic's rules; its minimum of 1024 is not kept)."""
    t = body.thinking
    if t is None or t.type == "disabled":
        return False, None
    if t.budget_tokens is None:
        raise APIError(
            400, "thinking.budget_tokens: required when type is enabled", param="thinking"
        )
    if t.budget_tokens >= body.max_tokens:
        raise APIError(
            400,
            f"thinking.budget_tokens: must be less than max_tokens ({body.max_tokens}), "
            f"got {t.budget_tokens}",
            param="thinking",
        )
    return True, t.budget_tokens


class AnthropicResponseBuilder(ResponseBuilder):
    id_prefix = "msg_"
    tool_id_prefix = "toolu_"

    def prepare(
        self, body: MessagesRequest, tokenizer: AutoTokenizer, settings: ServeSettings
    ) -> Prepared:
        messages: list[dict[str, Any]] = []
        if body.system:
            messages.append({"role": "system", "content": _text(body.system)})
        for m in body.messages:
            messages += _messages(m)
        tools = None
        choice = body.tool_choice
        if body.tools and (choice is None or choice.type != "none"):
            tools = [
                {
                    "type": "function",
                    "function": {
                        "name": t.name,
                        "description": t.description or "",
                        "parameters": t.input_schema,
                    },
                }
                for t in body.tools
            ]
        if choice is not None and choice.type == "tool":  # render only that tool
            tools = [t for t in tools or [] if t["function"]["name"] == choice.name]
            if not tools:
                raise APIError(
                    400, f"tool_choice names an unknown tool {choice.name!r}", param="tool_choice"
                )
        if choice is not None and choice.type == "any" and not body.tools:
            raise APIError(400, "tool_choice: any needs tools", param="tool_choice")
        extra: dict[str, Any] = {}
        if tools and choice is not None and choice.type in ("any", "tool"):  # forced call
            functions = [t["function"] for t in tools]
            extra["structured"] = tool_call_constraint(functions, settings, tokenizer)
        field = given(body, "max_tokens")
        thinking, budget = _thinking(body)
        # The template's switch, set only where a reasoning parser reads the thinking.
        parses = check_reasoning_parser(settings.reasoning_parser) is not None
        kwargs = {"enable_thinking": thinking} if parses else None
        prompt_ids = render_prompt(tokenizer, messages, tools, kwargs)
        reasoning = reasoning_for(
            settings.reasoning_parser, tokenizer, prompt_ids, enabled=thinking, budget=budget
        )
        if reasoning is not None:  # harmony: its markers kept in the text, its stop tokens
            extra.update(reasoning.sampling_fields(tokenizer))
        if "structured" in extra:  # a forced call comes after the thinking
            extra["structured"] = after_reasoning(extra["structured"], reasoning, tokenizer)
        budget_cap = thinking_budget(reasoning, tokenizer)
        if budget_cap:
            extra["logits_processors"] = budget_cap
        return Prepared(
            prompts=[prompt_ids],
            reasoning=reasoning,
            params=anthropic_params(body, settings, max_tokens_param=field, **extra),
            max_tokens_param=field,
            stops=stop_strings(body.stop_sequences),
            parse_tools=tools is not None,
            tool_defs=[t["function"] for t in tools] if tools else None,
            stream=bool(body.stream),
            model=settings.model_name,  # the id /v1/models lists, whatever was asked
        )

    def error_body(self, err: APIError) -> dict[str, Any]:
        return anthropic_error_body(err)

    def _usage(self, ctx: RequestContext) -> dict[str, int]:
        return {"input_tokens": ctx.prompt_tokens, "output_tokens": ctx.completion_tokens}

    # ------------------------------------------------------------------ streaming
    def format_stream_start(self, ctx: RequestContext) -> list[str]:
        ctx.extra.update(open_text=None, blocks=0)
        message = {
            "id": ctx.id,
            "type": "message",
            "role": "assistant",
            "model": ctx.model,
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": {"input_tokens": ctx.prompt_tokens, "output_tokens": 0},
        }
        return [sse({"type": "message_start", "message": message}, "message_start")]

    def _open(self, ctx: RequestContext, block: dict[str, Any]) -> tuple[int, str]:
        index = ctx.extra["blocks"]
        ctx.extra["blocks"] += 1
        event = {"type": "content_block_start", "index": index, "content_block": block}
        return index, sse(event, "content_block_start")

    def _close_text(self, ctx: RequestContext) -> list[str]:
        index = ctx.extra["open_text"]
        if index is None:
            return []
        ctx.extra["open_text"] = None
        return [sse({"type": "content_block_stop", "index": index}, "content_block_stop")]

    def _delta(self, index: int, delta: dict[str, Any]) -> str:
        return sse(
            {"type": "content_block_delta", "index": index, "delta": delta}, "content_block_delta"
        )

    def _close_thinking(self, ctx: RequestContext) -> list[str]:
        """End the open thinking block: its (empty) signature, then content_block_stop."""
        index = ctx.extra.pop("open_thinking", None)
        if index is None:
            return []
        signature = {"type": "signature_delta", "signature": ""}
        return [
            self._delta(index, signature),
            sse({"type": "content_block_stop", "index": index}, "content_block_stop"),
        ]

    def format_chunk(self, ctx: RequestContext, choice: Choice, event: Event) -> list[str]:
        out: list[str] = []
        if isinstance(event, ReasoningDelta):  # a thinking block, before any text block
            if ctx.extra.get("open_thinking") is None:
                block = {"type": "thinking", "thinking": "", "signature": ""}
                ctx.extra["open_thinking"], start = self._open(ctx, block)
                out.append(start)
            delta = {"type": "thinking_delta", "thinking": event.text}
            return [*out, self._delta(ctx.extra["open_thinking"], delta)]
        out += self._close_thinking(ctx)
        if isinstance(event, TextDelta):
            if ctx.extra["open_text"] is None:
                index, start = self._open(ctx, {"type": "text", "text": ""})
                ctx.extra["open_text"] = index
                out.append(start)
            out.append(
                self._delta(ctx.extra["open_text"], {"type": "text_delta", "text": event.text})
            )
            return out
        out += self._close_text(ctx)
        block = {"type": "tool_use", "id": event.id, "name": event.name, "input": {}}
        index, start = self._open(ctx, block)
        out.append(start)
        out += [  # the arguments in fragments (they concatenate to the parsed call's JSON)
            self._delta(index, {"type": "input_json_delta", "partial_json": piece})
            for piece in argument_fragments(event.arguments)
        ]
        out.append(sse({"type": "content_block_stop", "index": index}, "content_block_stop"))
        return out

    def format_choice_end(self, ctx: RequestContext, choice: Choice) -> list[str]:
        out = self._close_thinking(ctx) + self._close_text(ctx)
        if ctx.extra["blocks"] == 0:  # always at least one (empty) text block
            index, start = self._open(ctx, {"type": "text", "text": ""})
            out += [
                start,
                sse({"type": "content_block_stop", "index": index}, "content_block_stop"),
            ]
        delta = {"stop_reason": _STOP[choice.finish_reason], "stop_sequence": choice.stop_sequence}
        out.append(
            sse(
                {"type": "message_delta", "delta": delta, "usage": self._usage(ctx)},
                "message_delta",
            )
        )
        out.append(sse({"type": "message_stop"}, "message_stop"))
        return out

    def format_stream_end(self, ctx: RequestContext) -> list[str]:
        return [sse("[DONE]")]  # after message_stop; the SDK skips it (Amendment 3)

    def format_stream_error(self, ctx: RequestContext, err: APIError) -> list[str]:
        return [sse(self.error_body(err), "error")]

    # ------------------------------------------------------------------ plain
    def format_response(self, ctx: RequestContext) -> dict[str, Any]:
        choice = ctx.choices[0]
        content: list[dict[str, Any]] = []
        if choice.reasoning:  # the signature is empty: nothing here verifies a thinking block
            content.append(
                {"type": "thinking", "thinking": choice.reasoning_content, "signature": ""}
            )
        if choice.content or not (choice.tool_calls or choice.reasoning):
            content.append({"type": "text", "text": choice.content})
        content += [
            {"type": "tool_use", "id": t.id, "name": t.name, "input": t.input}
            for t in choice.tool_calls
        ]
        return {
            "id": ctx.id,
            "type": "message",
            "role": "assistant",
            "model": ctx.model,
            "content": content,
            "stop_reason": _STOP[choice.finish_reason or "stop"],
            "stop_sequence": choice.stop_sequence,
            "usage": self._usage(ctx),
        }
