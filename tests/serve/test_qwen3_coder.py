"""`Qwen3CoderToolParser` (qwen3_coder.py): values converted by the tool's schema, and the
reference parser's reading of unclosed and undeclared parts."""

from __future__ import annotations

import pytest
from tool_parser_cases import reference_cases, run, splits


def test_qwen3_coder_converts_values_by_schema():
    schema = {
        "type": "object",
        "properties": {
            "n": {"type": "integer"},
            "x": {"type": "number"},
            "ok": {"type": "boolean"},
            "o": {"type": "object"},
            "s": {"type": "string"},
            "maybe": {"type": ["integer", "null"]},
        },
    }
    body = "".join(
        f"<parameter={k}>\n{v}\n</parameter>\n"
        for k, v in [
            ("n", "7"),
            ("x", "2.5"),
            ("ok", "False"),
            ("o", '{"a": [1]}'),
            ("s", "007\nline 2"),
            ("maybe", "null"),
            ("free", "[1, 2]"),
        ]
    )
    out = f"<tool_call>\n<function=f>\n{body}</function>\n</tool_call>"
    text, [(name, args)] = run("qwen3_coder", [out], tools=[{"name": "f", "parameters": schema}])
    assert text == "" and name == "f"
    assert args == {
        "n": 7,
        "x": 2.5,
        "ok": False,
        "o": {"a": [1]},
        "s": "007\nline 2",
        "maybe": None,
        "free": "[1, 2]",  # not declared: the text as written (the reference parser's)
    }


@pytest.mark.parametrize(("parser", "tools", "out", "want"), reference_cases("qwen3_coder"))
def test_the_reference_parsers_reading_whole_and_in_random_chunks(parser, tools, out, want):
    for pieces in splits(out, seed=3):
        assert run(parser, pieces, tools=tools) == want, pieces


def test_qwen3_coder_call_cut_before_its_function_end_stays_text():
    """Cut off inside the call (max_tokens): no `</function>`, so no complete call."""
    out = "<tool_call>\n<function=get_time>\n<parameter=tz>\nUT"
    for pieces in splits(out)[:20]:
        assert run("qwen3_coder", pieces) == (out, [])
