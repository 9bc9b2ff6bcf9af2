"""`MistralToolParser` (mistral.py): the v11 spelling, content before the calls."""

from __future__ import annotations

from tool_parser_cases import run


def test_mistral_v11_spelling_and_content_before():
    out = (
        'Sure.[TOOL_CALLS]get_weather[ARGS]{"city": "Oslo"}[TOOL_CALLS]get_time[ARGS]{"tz": "UTC"}'
    )
    assert run("mistral", [out]) == (
        "Sure.",
        [("get_weather", {"city": "Oslo"}), ("get_time", {"tz": "UTC"})],
    )
