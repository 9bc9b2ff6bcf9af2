"""A choice's output parser (stream.py): stop strings on text streams, split at every possible
point, applied before the tool-call parser."""

from __future__ import annotations

import pytest
from tool_parser_cases import feed_output, splits

from astrai.serve.tool_parsers import OutputParser, StopMatcher, resolve


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
    for pieces in splits(text):
        parser = OutputParser(stops)
        out, _ = feed_output(parser, pieces)
        assert (out, parser.matched_stop) == (expect, matched), pieces


def test_stop_matcher_never_emits_a_stop_prefix_early():
    m = StopMatcher(["STOP"])
    assert m.feed("abc ST") == "abc "
    assert m.feed("O") == ""
    assert m.feed("P tail") == ""
    assert m.matched == "STOP"


CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "n": 2}}\n</tool_call>'


def test_stop_string_applies_before_tool_parsing():
    parser = OutputParser(["<tool_call>"], resolve("hermes").new())
    out, calls = feed_output(parser, ["Hi ", CALL])
    assert (out, calls) == ("Hi ", [])
    assert parser.tool_calls == []
