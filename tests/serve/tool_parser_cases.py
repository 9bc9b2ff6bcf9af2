"""Shared cases of the tool-parser tests: tools, and each format's spelling of calls.

The spellings are written here from the formats' public descriptions (vLLM's parsers,
the models' chat templates), independently of astrai.serve.tool_parsers; `run` and
`splits` (at the end) feed them to the family, one test file per parser module.
"""

from __future__ import annotations

import json
import random
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
TOOL_DEFS = [{"name": n, "parameters": s} for n, s in SCHEMAS.items()]  # `function`s
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


# The family formats' own reading of four outputs where astrai read otherwise (#44.12),
# transcribed from the reference parsers: Qwen3-Coder's (`qwen3coder_tool_parser.py`, in
# Qwen's model repo and vLLM: `<tool_call>(.*?)</tool_call>|<tool_call>(.*?)$`, and an
# undeclared parameter's value returned as its string) and vLLM's hermes (a call is
# `json.loads(body)` with `["name"]` and `["arguments"]`; anything else is content).
QWEN3_CODER_TOOLS = [{"name": "f", "parameters": {"properties": {"n": {"type": "integer"}}}}]
REFERENCE_CASES = [
    (  # a complete call the output ends without </tool_call> is a call
        "qwen3_coder",
        TOOL_DEFS,
        "Let me check.\n<tool_call>\n<function=get_time>\n<parameter=tz>\nUTC\n</parameter>"
        "\n</function>",
        ("Let me check.", [("get_time", {"tz": "UTC"})]),
    ),
    (  # the second of two calls is unclosed
        "qwen3_coder",
        TOOL_DEFS,
        "<tool_call>\n<function=get_time>\n<parameter=tz>\nUTC\n</parameter>\n</function>\n"
        "</tool_call>\n<tool_call>\n<function=get_weather>\n<parameter=city>\nRome\n"
        "</parameter>\n<parameter=days>\n2\n</parameter>\n</function>\n",
        ("", [("get_time", {"tz": "UTC"}), ("get_weather", {"city": "Rome", "days": 2})]),
    ),
    (  # a parameter the tool does not declare stays a string (null is None)
        "qwen3_coder",
        QWEN3_CODER_TOOLS,
        "<tool_call>\n<function=f>\n<parameter=n>\n42\n</parameter>\n<parameter=extra>\n42\n"
        "</parameter>\n<parameter=flag>\ntrue\n</parameter>\n<parameter=none>\nnull\n"
        "</parameter>\n</function>\n</tool_call>",
        ("", [("f", {"n": 42, "extra": "42", "flag": "true", "none": None})]),
    ),
    (  # hermes: only `arguments` holds the arguments; `parameters` is no call
        "hermes",
        TOOL_DEFS,
        '<tool_call>\n{"name": "get_time", "parameters": {"tz": "UTC"}}\n</tool_call>',
        ('<tool_call>\n{"name": "get_time", "parameters": {"tz": "UTC"}}\n</tool_call>', []),
    ),
]


def reference_cases(parser: str) -> list[tuple]:
    """`REFERENCE_CASES` of one parser (its test file's)."""
    return [case for case in REFERENCE_CASES if case[0] == parser]


def run(parser: str, pieces: list[str], tools=TOOL_DEFS) -> tuple[str, list[tuple[str, dict]]]:
    """`pieces` fed to a fresh parser of the `parser` choice: the content and the calls."""
    from astrai.serve.tool_parsers import TextDelta, ToolCall, resolve

    p = resolve(parser).new(tools)
    events = [e for piece in pieces for e in p.feed(piece)] + p.flush()
    text = "".join(e.text for e in events if isinstance(e, TextDelta))
    calls = [e for e in events if isinstance(e, ToolCall)]
    assert [c.index for c in calls] == list(range(len(calls)))
    assert calls == p.calls
    return text, [(c.name, json.loads(c.arguments)) for c in calls]


def feed_output(parser, pieces: list[str]) -> tuple[str, list]:
    """`pieces` fed to an `OutputParser` (stop strings, then the tool parser): the content and
    the `ToolCall` events."""
    from astrai.serve.tool_parsers import TextDelta, ToolCall

    events = [e for piece in pieces for e in parser.feed(piece)] + parser.flush()
    text = "".join(e.text for e in events if isinstance(e, TextDelta))
    return text, [e for e in events if isinstance(e, ToolCall)]


def splits(text: str, seed: int = 0) -> list[list[str]]:
    """The whole text, one character at a time, every cut in two, random chunks."""
    rng = random.Random(seed)
    out = [[text], list(text)] + [[text[:i], text[i:]] for i in range(1, len(text))]
    for _ in range(5):
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, 6)))
        out.append([text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])])
    return out
