"""The protocols' structured-output fields as engine constraints (`StructuredOutput`).

OpenAI `response_format` (`json_object`, `json_schema`) constrains the answer's text;
`tool_choice: "required"` (Anthropic `{"type": "any"}`) or a named function (Anthropic
`{"type": "tool"}`) constrains it to one call, in the server's tool-call format, of one of
the allowed tools with arguments valid under that tool's parameters schema. A forced tool
call takes precedence over `response_format`. Constraints are compiled here, in the
prepare step (a worker thread), so a bad schema is a 400 naming its field before anything
is queued, and the engine finds the grammar compiled. A forced call chooses among at most
`MAX_FORCED_TOOLS` tools (OpenAI's limit on `tools`): thousands of them make a grammar past
what llguidance can compile (~1,900 small tools), and a larger one is refused in our words
before it is built.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from astrai.inference.grammar import grammar_compiler
from astrai.inference.structured import StructuredOutput
from astrai.serve.errors import APIError
from astrai.serve.schemas import ResponseFormat
from astrai.serve.settings import ServeSettings
from astrai.serve.tool_parsers import resolve as resolve_tool_parser
from astrai.tokenizer import AutoTokenizer

# The most tools a forced `tool_choice` may choose among (OpenAI's documented maximum).
MAX_FORCED_TOOLS = 128


def response_format_constraint(
    fmt: ResponseFormat | None, tokenizer: AutoTokenizer
) -> StructuredOutput | None:
    """OpenAI `response_format` -> a constraint (None for `text` or no format)."""
    if fmt is None or fmt.type == "text":
        return None
    field = "response_format"
    if fmt.type == "json_object":
        return compiled(lambda: StructuredOutput.json_object(field=field), tokenizer, field)
    if fmt.json_schema is None or fmt.json_schema.schema_ is None:
        raise APIError(
            400,
            "response_format.json_schema.schema: required when type is json_schema",
            param="response_format",
        )
    schema = fmt.json_schema.schema_
    return compiled(lambda: StructuredOutput.json_schema(schema, field=field), tokenizer, field)


def tool_call_constraint(
    tools: Sequence[dict[str, Any]], settings: ServeSettings, tokenizer: AutoTokenizer
) -> StructuredOutput:
    """One call of one of `tools` (`{"name", "parameters"}`) in the server's tool-call
    format; a 400 naming `tools` if there are more than `MAX_FORCED_TOOLS` or a parameters
    schema does not compile."""
    if len(tools) > MAX_FORCED_TOOLS:
        raise APIError(
            400,
            f"tools: {len(tools)} tools, but a forced tool call (tool_choice required / any) "
            f"chooses among at most {MAX_FORCED_TOOLS}: send fewer tools, or let the model "
            "choose (tool_choice auto)",
            param="tools",
        )
    parser = resolve_tool_parser(settings.tool_parser, tokenizer.chat_template)
    if parser is None:
        raise APIError(
            400,
            "tool_choice: cannot force a tool call, the server parses none (tool_parser is none)",
            param="tool_choice",
        )
    start, end = parser.forced  # the parser's tags around a JSON call, which it reads back
    return compiled(
        lambda: StructuredOutput.tool_call(tools, start=start, end=end, field="tools"),
        tokenizer,
        "tools",
    )


def compiled(make: Any, tokenizer: AutoTokenizer, field: str) -> StructuredOutput:
    """`make()` compiled against `tokenizer` now: a spec or grammar that does not build is
    a 400 naming `field`, before anything is queued."""
    try:
        spec = make()
        grammar_compiler(tokenizer).compile(spec)
    except ValueError as err:
        raise APIError(400, str(err), param=field) from err
    except RecursionError:  # a schema nested past what its serializer can walk
        raise APIError(400, f"{field}: the schema is nested too deeply", param=field) from None
    return spec
