"""`PythonicToolParser` (pythonic.py): Llama 4's wrapping, JSON constants as literals."""

from __future__ import annotations

from tool_parser_cases import run


def test_pythonic_llama4_wrapping_and_json_constants():
    out = '<|python_start|>[get_weather(city="Oslo", hot=false)]<|python_end|>'
    assert run("pythonic", [out]) == ("", [("get_weather", {"city": "Oslo", "hot": False})])
