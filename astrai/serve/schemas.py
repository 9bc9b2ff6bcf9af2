"""Request bodies of both protocols (pydantic), with the spec's defaults and ranges.

Unknown fields are ignored (SDKs add new optional fields faster than we add support),
but every field we read is typed and range-checked, so a bad value is a 400 that names
the field rather than an error deep in the engine. The limits the engine applies too
(penalties, logit bias, log-probs, stop strings, `n`) are the engine's constants.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictInt, StrictStr

from astrai.inference.params import (
    MAX_LOGIT_BIAS,
    MAX_LOGPROBS,
    MAX_N,
    MAX_PENALTY,
    MAX_STOPS,
)


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")


def given(body: BaseModel, *names: str) -> str | None:
    """The first of `names` the request set to a value (not left to its default, not null):
    an explicit `max_tokens` is held to the context, a default is capped to it."""
    return next(
        (n for n in names if n in body.model_fields_set and getattr(body, n) is not None), None
    )


# --------------------------------------------------------------------------- OpenAI


class TextPart(_Body):
    type: Literal["text"]
    text: str


class FunctionCall(_Body):
    name: str
    arguments: str | dict[str, Any] | None = None


class OpenAIToolCall(_Body):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[OpenAIToolCall] | None = None
    tool_call_id: str | None = None


class FunctionDef(_Body):
    name: Annotated[str, Field(min_length=1)]
    description: str | None = None
    parameters: dict[str, Any] | None = None


class OpenAITool(_Body):
    type: Literal["function"] = "function"
    function: FunctionDef


class NamedToolChoice(_Body):
    type: Literal["function"] = "function"
    function: dict[str, str]


class StreamOptions(_Body):
    include_usage: bool = False


class JsonSchemaFormat(_Body):
    """`response_format.json_schema`: the schema the answer must match (`strict` or not,
    the output is constrained to it)."""

    model_config = ConfigDict(extra="ignore", populate_by_name=True)

    name: str = "response"
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Body):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsParams(_Body):
    """vLLM's `structured_outputs` (extra body): exactly one constraint kind; checked and
    compiled by `astrai.serve.structured_outputs`. `json` is the wire name (an alias: the
    attribute would shadow pydantic's `BaseModel.json`)."""

    model_config = ConfigDict(extra="ignore", populate_by_name=True)

    json_: Any = Field(default=None, alias="json")  # a schema or its text: checked on use
    regex: StrictStr | None = None
    choice: list[StrictStr] | None = None
    grammar: StrictStr | None = None
    json_object: bool | None = None
    # vLLM options this server does not implement: a 400 naming them, never ignored.
    structural_tag: Any = None
    whitespace_pattern: Any = None


class ChatCompletionRequest(_Body):
    model: str | None = "astrai"  # null: the base model, as in vLLM
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] | None = 1.0
    top_p: Annotated[float, Field(ge=0.0, le=1.0)] | None = 1.0
    top_k: Annotated[int, Field(ge=-1)] | None = 50
    min_p: Annotated[float, Field(ge=0.0, le=1.0)] | None = 0.0
    max_tokens: Annotated[int, Field(ge=1)] | None = 2048
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    stop: str | Annotated[list[str], Field(max_length=MAX_STOPS)] | None = None
    n: Annotated[int, Field(ge=1, le=MAX_N)] | None = 1
    best_of: Annotated[int, Field(ge=1, le=MAX_N)] | None = None  # vLLM's; see best_of.py
    presence_penalty: Annotated[float, Field(ge=-MAX_PENALTY, le=MAX_PENALTY)] | None = 0.0
    frequency_penalty: Annotated[float, Field(ge=-MAX_PENALTY, le=MAX_PENALTY)] | None = 0.0
    logit_bias: dict[int, Annotated[float, Field(ge=-MAX_LOGIT_BIAS, le=MAX_LOGIT_BIAS)]] | None = (
        None
    )
    seed: int | None = None
    priority: int | None = 0  # vLLM's: lower first under engine.scheduling_policy=priority
    user: str | None = None
    tools: list[OpenAITool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = "auto"
    response_format: ResponseFormat | None = None
    chat_template_kwargs: dict[str, Any] | None = None  # template variables (enable_thinking)
    # OpenAI's; handed to the chat template as `reasoning_effort` (GPT-OSS's reads it)
    reasoning_effort: Literal["minimal", "low", "medium", "high"] | None = None
    logprobs: bool | None = False
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    structured_outputs: StructuredOutputsParams | None = None  # vLLM's extra body field
    add_generation_prompt: bool = True  # vLLM's: false renders no assistant header


# One prompt of the legacy completions API: text, or token ids (strict: "1" is not a token).
TokenIds = Annotated[list[StrictInt], Field(min_length=1)]


class CompletionRequest(_Body):
    """Legacy `/v1/completions` (what lm-eval's `local-completions` speaks)."""

    model: str | None = "astrai"  # null: the base model, as in vLLM
    prompt: StrictStr | list[StrictStr] | TokenIds | list[TokenIds]
    suffix: str | None = None
    max_tokens: Annotated[int, Field(ge=0)] | None = 16
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] | None = 1.0
    top_p: Annotated[float, Field(ge=0.0, le=1.0)] | None = 1.0
    top_k: Annotated[int, Field(ge=-1)] | None = 0
    min_p: Annotated[float, Field(ge=0.0, le=1.0)] | None = 0.0
    n: Annotated[int, Field(ge=1, le=MAX_N)] | None = 1
    best_of: Annotated[int, Field(ge=1, le=MAX_N)] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    echo: bool | None = False
    stop: str | Annotated[list[str], Field(max_length=MAX_STOPS)] | None = None
    presence_penalty: Annotated[float, Field(ge=-MAX_PENALTY, le=MAX_PENALTY)] | None = 0.0
    frequency_penalty: Annotated[float, Field(ge=-MAX_PENALTY, le=MAX_PENALTY)] | None = 0.0
    logit_bias: dict[int, Annotated[float, Field(ge=-MAX_LOGIT_BIAS, le=MAX_LOGIT_BIAS)]] | None = (
        None
    )
    seed: int | None = None
    priority: int | None = 0  # vLLM's: lower first under engine.scheduling_policy=priority
    user: str | None = None
    structured_outputs: StructuredOutputsParams | None = None  # vLLM's extra body field


# --------------------------------------------------------------------------- Anthropic


class AnthropicText(_Body):
    type: Literal["text"]
    text: str


class AnthropicToolUse(_Body):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any] = Field(default_factory=dict)


class AnthropicToolResult(_Body):
    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[AnthropicText] | None = None
    is_error: bool | None = None


class AnthropicThinkingBlock(_Body):
    """A `thinking` / `redacted_thinking` block sent back in the history (not rendered)."""

    type: Literal["thinking", "redacted_thinking"]
    thinking: str | None = None
    signature: str | None = None
    data: str | None = None


class AnthropicThinking(_Body):
    """`thinking`: `{"type": "enabled", "budget_tokens": n}` or `{"type": "disabled"}`."""

    type: Literal["enabled", "disabled"]
    budget_tokens: Annotated[int, Field(ge=1)] | None = None


AnthropicBlock = Annotated[
    AnthropicText | AnthropicToolUse | AnthropicToolResult | AnthropicThinkingBlock,
    Field(discriminator="type"),
]


class AnthropicMessage(_Body):
    role: Literal["user", "assistant"]
    content: str | list[AnthropicBlock]


class AnthropicTool(_Body):
    name: Annotated[str, Field(min_length=1)]
    description: str | None = None
    input_schema: dict[str, Any] = Field(default_factory=lambda: {"type": "object"})


class AnthropicToolChoice(_Body):
    type: Literal["auto", "any", "tool", "none"] = "auto"
    name: str | None = None


class MessagesRequest(_Body):
    model: str | None = "astrai"  # null: the base model, as in vLLM
    messages: Annotated[list[AnthropicMessage], Field(min_length=1)]
    system: str | list[AnthropicText] | None = None
    max_tokens: Annotated[int, Field(ge=1)] = 1024
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] | None = 1.0
    top_p: Annotated[float, Field(ge=0.0, le=1.0)] | None = 1.0
    top_k: Annotated[int, Field(ge=-1)] | None = 50
    stream: bool | None = False
    stop_sequences: Annotated[list[str], Field(max_length=MAX_STOPS)] | None = None
    priority: int | None = 0  # vLLM's: lower first under engine.scheduling_policy=priority
    tools: list[AnthropicTool] | None = None
    tool_choice: AnthropicToolChoice | None = None
    thinking: AnthropicThinking | None = None


class CountTokensRequest(_Body):
    """Anthropic `/v1/messages/count_tokens`: a Messages request without sampling."""

    model: str | None = "astrai"  # null: the base model, as in vLLM
    messages: Annotated[list[AnthropicMessage], Field(min_length=1)]
    system: str | list[AnthropicText] | None = None
    tools: list[AnthropicTool] | None = None
    tool_choice: AnthropicToolChoice | None = None
    thinking: AnthropicThinking | None = None

    def as_messages_request(self) -> MessagesRequest:
        """The Messages request whose prompt this counts."""
        return MessagesRequest.model_validate(self.model_dump(exclude_unset=True))
