"""`ToolParser`'s shared machinery (base.py), over every parser of the family: any split of
the output into deltas gives the same events, calls come out as written, bad output stays
text, a tools list refuses unknown names, the forced spelling is read back."""

from __future__ import annotations

import jsonschema
import pytest
from tool_parser_cases import (
    CALL_A,
    CALL_B,
    CALLS_ONLY,
    PARSERS,
    SCHEMAS,
    hostile,
    run,
    spell,
    splits,
)

from astrai.serve.tool_parsers import argument_fragments, resolve


@pytest.mark.parametrize("parser", PARSERS)
def test_calls_come_out_as_written_under_any_split(parser):
    content = "" if parser in CALLS_ONLY else "Let me check."
    for calls in ([CALL_A], [CALL_A, CALL_B]):
        out = spell(parser, calls, content)
        for pieces in splits(out):
            text, got = run(parser, pieces)
            assert (text, got) == (content, calls), pieces
        for name, args in got:
            jsonschema.validate(args, SCHEMAS[name])


@pytest.mark.parametrize("parser", PARSERS)
def test_hostile_output_stays_text_under_any_split(parser):
    for out in hostile(parser):
        for pieces in splits(out, seed=1)[:40]:
            assert run(parser, pieces) == (out, []), (out, pieces)


@pytest.mark.parametrize("parser", PARSERS)
def test_plain_text_passes_through(parser):
    for out in ("Paris is sunny.", "  [1, 2] is a list", "{not a call}", "a [b] c", ""):
        for pieces in splits(out or "x")[:10] if out else [[""]]:
            assert run(parser, pieces) == (out, [])


def test_tools_none_accepts_any_name_and_tools_list_refuses_unknown():
    out = spell("hermes", [("other", {"x": 1})])
    assert run("hermes", [out], tools=None) == ("", [("other", {"x": 1})])
    assert run("hermes", [out]) == (out, [])


@pytest.mark.parametrize("parser", PARSERS)
def test_forced_spelling_is_read_back(parser):
    """What a forced tool_choice grammar writes (`start\\n{json}\\nend`) parses."""
    start, end = resolve(parser).forced
    out = f'{start}\n{{"name": "get_time", "arguments": {{"tz": "UTC"}}}}\n{end}'
    for pieces in splits(out)[:30]:
        assert run(parser, pieces) == ("", [("get_time", {"tz": "UTC"})])


def test_argument_fragments_concatenate_back_and_cut_outside_strings():
    args = '{"city": "a, b: c", "days": 3}'
    pieces = argument_fragments(args)
    assert "".join(pieces) == args
    assert pieces == ['{"city": ', '"a, b: c", ', '"days": ', "3}"]
