"""`Llama3JsonToolParser` (llama3_json.py): a call without `<|python_tag|>`, `arguments` as
well as `parameters`."""

from __future__ import annotations

from tool_parser_cases import run


def test_llama3_json_without_python_tag_and_arguments_key():
    out = ' {"name": "get_time", "arguments": {"tz": "UTC"}}'
    assert run("llama3_json", list(out)) == ("", [("get_time", {"tz": "UTC"})])
