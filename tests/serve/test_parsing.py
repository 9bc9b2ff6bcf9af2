"""Stop strings and tool-call parsing on text streams, split at every possible point."""

import json

import pytest

from astrai.serve.parsing import (
    OutputParser,
    StopMatcher,
    TextDelta,
    ToolCall,
    ToolCallFormat,
    tool_call_format,
)


def _run(parser: OutputParser, pieces: list[str]):
    events = []
    for p in pieces:
        events += parser.feed(p)
    events += parser.flush()
    text = "".join(e.text for e in events if isinstance(e, TextDelta))
    return text, [e for e in events if isinstance(e, ToolCall)]


def _splits(text: str):
    yield [text]
    yield list(text)
    for i in range(1, len(text)):
        yield [text[:i], text[i:]]


@pytest.mark.parametrize(
    "text, stops, expect, matched",
    [
        ("Hello world, bye", ["world"], "Hello ", "world"),
        ("Hello world", ["xyz"], "Hello world", None),
        ("abcabd", ["abd"], "abc", "abd"),  # a failed partial match is released
        ("one two three", ["three", "two"], "one ", "two"),  # the earliest match wins
        ("Hello wor", ["world"], "Hello wor", None),  # held text comes back at the end
    ],
)
def test_stop_strings_at_every_split(text, stops, expect, matched):
    for pieces in _splits(text):
        parser = OutputParser(stops)
        out, _ = _run(parser, pieces)
        assert (out, parser.matched_stop) == (expect, matched), pieces


def test_stop_matcher_never_emits_a_stop_prefix_early():
    m = StopMatcher(["STOP"])
    assert m.feed("abc ST") == "abc "
    assert m.feed("O") == ""
    assert m.feed("P tail") == ""
    assert m.matched == "STOP"


CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "n": 2}}\n</tool_call>'


@pytest.mark.parametrize(
    "text, content, calls",
    [
        (CALL, "", [("get_weather", {"city": "Paris", "n": 2})]),
        ("Let me check.\n" + CALL, "Let me check.", [("get_weather", {"city": "Paris", "n": 2})]),
        (
            CALL + "\n" + CALL.replace("Paris", "Rome"),
            "",
            [("get_weather", {"city": "Paris", "n": 2}), ("get_weather", {"city": "Rome", "n": 2})],
        ),
        (
            '<tool_call>{"name": "f", "arguments": "{\\"a\\": 1}"}</tool_call>',
            "",
            [("f", {"a": 1})],
        ),
        ('<tool_call>{"name": "f"}</tool_call>', "", [("f", {})]),
        ("<tool_call>{not json}</tool_call>", "<tool_call>{not json}</tool_call>", []),
        (
            '<tool_call>{"arguments": {}}</tool_call>',
            '<tool_call>{"arguments": {}}</tool_call>',
            [],
        ),
        ('<tool_call>{"name": "f", "argu', '<tool_call>{"name": "f", "argu', []),  # unclosed
        ("plain text, no calls ", "plain text, no calls ", []),
        ("a < b <tool", "a < b <tool", []),
    ],
)
def test_tool_calls_at_every_split(text, content, calls):
    fmt = ToolCallFormat()
    for pieces in _splits(text):
        out, got = _run(OutputParser((), fmt), pieces)
        assert out == content, pieces
        assert [(c.name, json.loads(c.arguments)) for c in got] == calls, pieces
        assert [c.index for c in got] == list(range(len(calls)))
        assert len({c.id for c in got}) == len(got)


def test_stop_string_applies_before_tool_parsing():
    out, calls = _run(OutputParser(["<tool_call>"], ToolCallFormat()), ["Hi ", CALL])
    assert (out, calls) == ("Hi ", [])


def test_tool_call_format_config():
    assert tool_call_format("hermes") == ToolCallFormat("<tool_call>", "</tool_call>")
    assert tool_call_format("none") is None
    assert tool_call_format("[CALL]|[/CALL]") == ToolCallFormat("[CALL]", "[/CALL]")
    with pytest.raises(ValueError, match="tool call format"):
        tool_call_format("bogus")
    _, calls = _run(OutputParser((), tool_call_format("[C]|[/C]")), ['[C]{"name": "x"}[/C]'])
    assert [c.name for c in calls] == ["x"]
