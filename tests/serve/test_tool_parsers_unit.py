"""The tool parsers on their own: any split of the output into deltas gives the same
events, each format's calls come out as written, bad output stays text, and the
`tool_parser=` setting resolves (or is refused naming the choices)."""

from __future__ import annotations

import json
import random

import jsonschema
import pytest
from tool_parser_cases import (
    CALL_A,
    CALL_B,
    CALLS_ONLY,
    PARSERS,
    REFERENCE_CASES,
    SCHEMAS,
    TOOL_DEFS,
    hostile,
    spell,
)

from astrai.serve import ServeSettings
from astrai.serve.parsing import TextDelta, ToolCall
from astrai.serve.tool_parsers import TOOL_PARSER_CHOICES, detect, resolve
from astrai.tokenizer.chat_template import DEFAULT_CHAT_TEMPLATE


def run(parser: str, pieces: list[str], tools=TOOL_DEFS) -> tuple[str, list[tuple[str, dict]]]:
    p = resolve(parser).new(tools)
    events = [e for piece in pieces for e in p.feed(piece)] + p.flush()
    text = "".join(e.text for e in events if isinstance(e, TextDelta))
    calls = [e for e in events if isinstance(e, ToolCall)]
    assert [c.index for c in calls] == list(range(len(calls)))
    assert calls == p.calls
    return text, [(c.name, json.loads(c.arguments)) for c in calls]


def splits(text: str, seed: int = 0) -> list[list[str]]:
    """The whole text, one character at a time, every cut in two, random chunks."""
    rng = random.Random(seed)
    out = [[text], list(text)] + [[text[:i], text[i:]] for i in range(1, len(text))]
    for _ in range(5):
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, 6)))
        out.append([text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])])
    return out


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


@pytest.mark.parametrize(("parser", "tools", "out", "want"), REFERENCE_CASES)
def test_the_family_reference_parsers_reading_whole_and_in_random_chunks(parser, tools, out, want):
    for pieces in splits(out, seed=3):
        assert run(parser, pieces, tools=tools) == want, pieces


def test_qwen3_coder_call_cut_before_its_function_end_stays_text():
    """Cut off inside the call (max_tokens): no `</function>`, so no complete call."""
    out = "<tool_call>\n<function=get_time>\n<parameter=tz>\nUT"
    for pieces in splits(out)[:20]:
        assert run("qwen3_coder", pieces) == (out, [])


def test_mistral_v11_spelling_and_content_before():
    out = (
        'Sure.[TOOL_CALLS]get_weather[ARGS]{"city": "Oslo"}[TOOL_CALLS]get_time[ARGS]{"tz": "UTC"}'
    )
    assert run("mistral", [out]) == (
        "Sure.",
        [("get_weather", {"city": "Oslo"}), ("get_time", {"tz": "UTC"})],
    )


def test_pythonic_llama4_wrapping_and_json_constants():
    out = '<|python_start|>[get_weather(city="Oslo", hot=false)]<|python_end|>'
    assert run("pythonic", [out]) == ("", [("get_weather", {"city": "Oslo", "hot": False})])


def test_llama3_json_without_python_tag_and_arguments_key():
    out = ' {"name": "get_time", "arguments": {"tz": "UTC"}}'
    assert run("llama3_json", list(out)) == ("", [("get_time", {"tz": "UTC"})])


@pytest.mark.parametrize("parser", PARSERS)
def test_forced_spelling_is_read_back(parser):
    """What a forced tool_choice grammar writes (`start\\n{json}\\nend`) parses."""
    start, end = resolve(parser).forced
    out = f'{start}\n{{"name": "get_time", "arguments": {{"tz": "UTC"}}}}\n{end}'
    for pieces in splits(out)[:30]:
        assert run(parser, pieces) == ("", [("get_time", {"tz": "UTC"})])


def test_detect_from_template_text():
    assert detect(DEFAULT_CHAT_TEMPLATE) == "hermes"
    assert detect(None) == detect("{{ messages }}") == "hermes"
    assert detect("...<tool_call>\\n<function=example_function_name>...") == "qwen3_coder"
    assert detect("{{ '[TOOL_CALLS]' + x }}") == "mistral"
    assert detect("{{- '<|python_tag|>' }}") == "llama3_json"
    assert detect("[func_name1(params_name1=params_value1)]") == "pythonic"


def test_resolve_and_settings_name_the_choices():
    assert resolve("none") is None and resolve("auto").name == "hermes"
    tagged = resolve("[C]|[/C]")
    assert tagged.forced == ("[C]", "[/C]")
    assert run("[C]|[/C]", ['x [C]{"name": "get_time", "arguments": {}}[/C]']) == (
        "x",
        [("get_time", {})],
    )
    for bad in ("foo", "hermes2", "|x"):
        with pytest.raises(ValueError, match="tool_parser") as err:
            ServeSettings(tool_parser=bad)
        assert all(c in str(err.value) for c in TOOL_PARSER_CHOICES)
    assert ServeSettings(tool_parser="mistral").tool_parser_spec == "mistral"
    assert ServeSettings().tool_parser_spec == "hermes"  # tool_call_format's default


def test_cli_refuses_a_bad_tool_parser_before_loading():
    from astrai.serve.__main__ import settings_of

    with pytest.raises(SystemExit, match="tool_parser must be one of hermes, llama3_json"):
        settings_of({"model_path": "nowhere", "tool_parser": "foo"})
    assert settings_of({"model_path": "nowhere", "tool_parser": "auto"}).tool_parser == "auto"


def test_auto_on_a_served_model_reads_its_template(engine):
    from astrai.serve import create_app

    app = create_app(engine, ServeSettings(tool_parser="auto"))
    assert app.state.astrai.tool_parser.name == detect(engine.tokenizer.chat_template) == "hermes"
    assert create_app(engine, ServeSettings(tool_parser="none")).state.astrai.tool_parser is None
