"""`HermesToolParser` (hermes.py): ``<tool_call>{json}</tool_call>`` spans, with content before
them, split at every possible point; `tagged_parser`'s other tags ("START|END"); vLLM's
reading of a body (only ``arguments`` holds the arguments)."""

from __future__ import annotations

import json

import pytest
from tool_parser_cases import feed_output, reference_cases, run, splits

from astrai.serve.tool_parsers import OutputParser, resolve

HERMES = resolve("hermes")


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
    for pieces in splits(text):
        out, got = feed_output(OutputParser((), HERMES.new()), pieces)
        assert out == content, pieces
        assert [(c.name, json.loads(c.arguments)) for c in got] == calls, pieces
        assert [c.index for c in got] == list(range(len(calls)))
        assert len({c.id for c in got}) == len(got)


@pytest.mark.parametrize(("parser", "tools", "out", "want"), reference_cases("hermes"))
def test_the_reference_parsers_reading_whole_and_in_random_chunks(parser, tools, out, want):
    for pieces in splits(out, seed=3):
        assert run(parser, pieces, tools=tools) == want, pieces


def test_other_tags_read_as_hermes():
    tagged = resolve("[CALL]|[/CALL]")
    assert (tagged.name, tagged.forced) == ("[CALL]|[/CALL]", ("[CALL]", "[/CALL]"))
    _, calls = feed_output(
        OutputParser((), tagged.new()), ['[CALL]{"name": "x", "arguments": {}}[/CALL]']
    )
    assert [c.name for c in calls] == ["x"]
