"""The parsers' events and text helpers (events.py)."""

from __future__ import annotations

from astrai.serve.tool_parsers.events import TextDelta, ToolCall, emit_text, held_suffix


def test_held_suffix_is_the_longest_proper_prefix_of_a_pattern_at_the_end():
    assert held_suffix("abc <tool", ["<tool_call>"]) == 5
    assert held_suffix("abc <tool_call>", ["<tool_call>"]) == 0  # whole: not held, found
    assert held_suffix("x [", ["[TOOL_CALLS]", "<a>"]) == 1
    assert held_suffix("plain", ["<tool_call>"]) == 0


def test_emit_text_holds_back_trailing_whitespace():
    out: list = []
    held = emit_text("", "Let me check.\n ", out)
    assert (out, held) == ([TextDelta("Let me check.")], "\n ")
    assert emit_text(held, "  ", out) == "\n   " and len(out) == 1


def test_a_tool_calls_input_is_its_arguments_object():
    assert ToolCall(0, "call_1", "f", '{"a": [1]}').input == {"a": [1]}
