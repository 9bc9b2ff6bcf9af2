"""Shared cases of the tool-parser tests: tools, and each format's spelling of calls.

The spellings are written here from the formats' public descriptions (vLLM's parsers,
the models' chat templates), independently of astrai.serve.tool_parsers.
"""

from __future__ import annotations

import json
from typing import Any

PARSERS = ("hermes", "llama3_json", "mistral", "pythonic", "qwen3_coder")
# Formats whose answer is only calls (no content before them).
CALLS_ONLY = ("llama3_json", "pythonic")

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 12},
        "days": {"type": "integer", "minimum": 1, "maximum": 14},
        "hot": {"type": "boolean"},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 3},
    },
    "required": ["city"],
    "additionalProperties": False,
}
TIME = {
    "type": "object",
    "properties": {"tz": {"type": "string", "maxLength": 16}},
    "required": ["tz"],
    "additionalProperties": False,
}
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
OAI_TOOLS = [
    {"type": "function", "function": {"name": n, "description": n, "parameters": s}}
    for n, s in SCHEMAS.items()
]
ANT_TOOLS = [{"name": n, "description": n, "input_schema": s} for n, s in SCHEMAS.items()]
MSGS = [{"role": "user", "content": "Weather in Paris?"}]

CALL_A = ("get_weather", {"city": "Paris é", "days": 3, "hot": True, "tags": ["a b", "c"]})
CALL_B = ("get_time", {"tz": "Europe/Rome"})


def _py(value: Any) -> str:
    return repr(value)  # Python literals: True, 'x', [..]


def spell(parser: str, calls: list[tuple[str, dict]], content: str = "") -> str:
    """The model output that `parser`'s format gives to `content` followed by `calls`."""
    if parser == "hermes":
        return (content + "\n" if content else "") + "\n".join(
            f'<tool_call>\n{{"name": "{n}", "arguments": {json.dumps(a, ensure_ascii=False)}}}'
            "\n</tool_call>"
            for n, a in calls
        )
    if parser == "llama3_json":
        assert not content
        return "<|python_tag|>" + "; ".join(
            json.dumps({"name": n, "parameters": a}, ensure_ascii=False) for n, a in calls
        )
    if parser == "mistral":
        body = [{"name": n, "arguments": a} for n, a in calls]
        return content + "[TOOL_CALLS]" + json.dumps(body, ensure_ascii=False)
    if parser == "pythonic":
        assert not content
        return (
            "["
            + ", ".join(
                f"{n}(" + ", ".join(f"{k}={_py(v)}" for k, v in a.items()) + ")" for n, a in calls
            )
            + "]"
        )
    if parser == "qwen3_coder":
        spans = []
        for n, a in calls:
            params = "".join(
                f"<parameter={k}>\n{v if isinstance(v, str) else json.dumps(v)}\n</parameter>\n"
                for k, v in a.items()
            )
            spans.append(f"<tool_call>\n<function={n}>\n{params}</function>\n</tool_call>")
        return (content + "\n" if content else "") + "\n".join(spans)
    raise AssertionError(parser)


# Hostile outputs: (text, why). Each must come back as content, 200, no tool call.
def hostile(parser: str) -> list[str]:
    good = spell(parser, [CALL_A])
    unknown = spell(parser, [("rm_rf", {"path": "/"})])
    broken = {
        "hermes": '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par\n</tool_call>',
        "llama3_json": '<|python_tag|>{"name": "get_weather", "parameters": {"city": ',
        "mistral": '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}',
        "pythonic": '[get_weather(city="Paris", days=)]',
        "qwen3_coder": "<tool_call>\n<function=get_weather\n<parameter=city>\nParis\n</tool_call>",
    }[parser]
    not_literal = {
        "pythonic": "[get_weather(city=__import__('os').getcwd())]",
        "llama3_json": '<|python_tag|>{"name": "get_weather", "parameters": [1, 2]}',
    }.get(parser)
    cases = [unknown, broken, good[: len(good) * 2 // 3]]
    return cases + ([not_literal] if not_literal else [])
