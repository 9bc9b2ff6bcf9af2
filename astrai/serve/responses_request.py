"""`POST /v1/responses` request bodies (OpenAI's Responses API) and their chat messages.

A Responses request is read as a chat completion: its `instructions` become the system
message, its `input` items chat messages (`input_messages`), its flat function tools the
chat API's nested ones (`chat_request`), so the chat path's prompt rendering, tool-call
and reasoning parsing and sampling settings serve it unchanged
(`astrai.serve.responses_builder`). Fields we cannot honour (other tool types, images,
files, `background`) are 400s naming the field; unknown fields are ignored, as elsewhere.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, TypeAdapter, ValidationError

from astrai.serve.errors import APIError
from astrai.serve.schemas import ChatCompletionRequest


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")


class TextContent(_Body):
    """`input_text` (a user's), `output_text` (an assistant turn sent back) or `text`."""

    type: Literal["input_text", "output_text", "text"]
    text: str


class MessageItem(_Body):
    """A message: OpenAI's `EasyInputMessage` (no `type` needed) or an input / output
    message item."""

    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[TextContent]


class FunctionCallItem(_Body):
    """A call the model made earlier (sent back with the history)."""

    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str
    id: str | None = None


class FunctionCallOutputItem(_Body):
    """The client's result of a call (`call_id` names it)."""

    type: Literal["function_call_output"]
    call_id: str
    output: str | list[TextContent]


class ReasoningItem(_Body):
    """A reasoning item sent back with the history: accepted, not rendered (chat templates
    drop the thinking of earlier turns)."""

    type: Literal["reasoning"]


def _item_type(value: Any) -> str:
    """The item's tag: a raw dict's `type` (none: an easy input message) or a parsed item's."""
    if isinstance(value, MessageItem | FunctionCallItem | FunctionCallOutputItem | ReasoningItem):
        return value.type
    got = value.get("type") if isinstance(value, dict) else None
    return "message" if got is None else str(got)


InputItem = Annotated[
    Annotated[MessageItem, Tag("message")]
    | Annotated[FunctionCallItem, Tag("function_call")]
    | Annotated[FunctionCallOutputItem, Tag("function_call_output")]
    | Annotated[ReasoningItem, Tag("reasoning")],
    Discriminator(_item_type),
]
_ITEM = TypeAdapter(InputItem)


class FunctionTool(_Body):
    """The Responses API's flat function tool (the chat API nests it under `function`)."""

    type: Literal["function"]
    name: Annotated[str, Field(min_length=1)]
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class FunctionToolChoice(_Body):
    type: Literal["function"]
    name: str


class TextFormat(_Body):
    """`text.format`: the chat API's `response_format`, flattened (`name`, `schema`, `strict`
    sit beside `type`); the answer is constrained to it."""

    model_config = ConfigDict(extra="ignore", populate_by_name=True)

    type: Literal["text", "json_object", "json_schema"] = "text"
    name: str = "response"
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class TextConfig(_Body):
    format: TextFormat | None = None


class ReasoningConfig(_Body):
    """Responses' `reasoning`: its `effort` goes to the chat template (`reasoning_effort`)."""

    effort: Literal["minimal", "low", "medium", "high"] | None = None


class ResponsesRequest(_Body):
    model: str | None = "astrai"
    # Items are read by `input_items`: its errors name `input[i]` and one cause.
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    previous_response_id: str | None = None
    store: bool | None = True
    max_output_tokens: Annotated[int, Field(ge=1)] | None = None
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] | None = 1.0
    top_p: Annotated[float, Field(ge=0.0, le=1.0)] | None = 1.0
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | FunctionToolChoice | None = "auto"
    parallel_tool_calls: bool | None = True
    stream: bool | None = False
    text: TextConfig | None = None
    reasoning: ReasoningConfig | None = None
    background: bool | None = False
    metadata: dict[str, str] | None = None
    user: str | None = None


def _text(content: str | list[TextContent]) -> str:
    return content if isinstance(content, str) else "".join(p.text for p in content)


def input_items(
    body: ResponsesRequest,
) -> list[MessageItem | FunctionCallItem | FunctionCallOutputItem | ReasoningItem]:
    """The `input` list's items, typed; a 400 naming `input` and the first bad item."""
    assert not isinstance(body.input, str)
    if not body.input:
        raise APIError(
            400, "input: an empty list (send a string or at least one item)", param="input"
        )
    items = []
    for i, raw in enumerate(body.input):
        try:
            items.append(_ITEM.validate_python(raw))
        except ValidationError as err:
            first = max(err.errors(), key=lambda e: len(e["loc"]))  # the most specific
            where = "".join(f"[{x}]" if isinstance(x, int) else f".{x}" for x in first["loc"][1:])
            raise APIError(400, f"input[{i}]{where}: {first['msg']}", param="input") from None
    return items


def input_messages(body: ResponsesRequest) -> list[dict[str, Any]]:
    """`input` as chat messages (`ChatMessage` fields): a string is one user message; a
    model's function calls join the assistant turn they follow, a call's output is a
    `tool` message."""
    if isinstance(body.input, str):
        return [{"role": "user", "content": body.input}]
    out: list[dict[str, Any]] = []
    calls_open = False  # the last message is an assistant turn function calls may join
    for item in input_items(body):
        if isinstance(item, MessageItem):
            out.append({"role": item.role, "content": _text(item.content)})
            calls_open = item.role == "assistant"
        elif isinstance(item, FunctionCallItem):
            call = {
                "id": item.call_id,
                "type": "function",
                "function": {"name": item.name, "arguments": item.arguments},
            }
            if not calls_open:
                out.append({"role": "assistant", "content": ""})
                calls_open = True
            out[-1].setdefault("tool_calls", []).append(call)
        elif isinstance(item, FunctionCallOutputItem):
            out.append(
                {"role": "tool", "content": _text(item.output), "tool_call_id": item.call_id}
            )
            calls_open = False
    return out


def chat_request(body: ResponsesRequest, messages: list[dict[str, Any]]) -> ChatCompletionRequest:
    """The chat completion that generates this response from the whole conversation
    `messages` (the stored history and `input`, without the instructions). Responses has no
    `top_k`: off, as in OpenAI's API."""
    if body.background:
        raise APIError(
            400, "background: not supported (responses run in the foreground)", param="background"
        )
    system = [{"role": "system", "content": body.instructions}] if body.instructions else []
    if not any(m["role"] != "system" for m in messages):
        raise APIError(400, "input: no message to answer (only instructions)", param="input")
    fields: dict[str, Any] = {
        "model": body.model,
        "messages": system + messages,
        "temperature": body.temperature,
        "top_p": body.top_p,
        "top_k": 0,
        "stream": bool(body.stream),
        "tool_choice": "auto",
    }
    if body.max_output_tokens is not None:
        fields["max_completion_tokens"] = body.max_output_tokens
    if body.reasoning is not None and body.reasoning.effort is not None:
        fields["reasoning_effort"] = body.reasoning.effort
    if body.tools:
        fields["tools"] = [
            {
                "type": "function",
                "function": t.model_dump(include={"name", "description", "parameters"}),
            }
            for t in body.tools
        ]
    text_format = body.text.format if body.text is not None else None
    if text_format is not None and text_format.type != "text":
        fields["response_format"] = response_format(text_format)
    choice = body.tool_choice
    if isinstance(choice, FunctionToolChoice):
        fields["tool_choice"] = {"type": "function", "function": {"name": choice.name}}
    elif choice is not None:
        fields["tool_choice"] = choice
    return ChatCompletionRequest.model_validate(fields)


def response_format(text_format: TextFormat) -> dict[str, Any]:
    """`text.format` as the chat API's `response_format` (its checks and its 400s)."""
    if text_format.type != "json_schema":
        return {"type": text_format.type}
    schema = text_format.model_dump(
        include={"name", "description", "schema_", "strict"}, by_alias=True, exclude_none=True
    )
    return {"type": "json_schema", "json_schema": schema}


def text_echo(body: ResponsesRequest) -> dict[str, Any]:
    """The Response's `text` field: the format the answer followed (plain text by default)."""
    text_format = body.text.format if body.text is not None else None
    if text_format is None:
        return {"format": {"type": "text"}}
    return {"format": text_format.model_dump(by_alias=True, exclude_none=True)}
