"""The family's registry (tool_parsers/__init__.py): `detect` from a chat template, `resolve`
of the `tool_parser` setting (or a refusal naming the choices), `auto` on a served model,
`ToolParserChoice.parse_text`, and the removed `tool_call_format` setting."""

from __future__ import annotations

import pytest
from tool_parser_cases import run

from astrai.serve import ServeSettings
from astrai.serve.tool_parsers import TOOL_PARSER_CHOICES, detect, resolve
from astrai.tokenizer.chat_template import DEFAULT_CHAT_TEMPLATE


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
    assert ServeSettings(tool_parser="mistral").tool_parser == "mistral"
    assert ServeSettings().tool_parser == "hermes"  # the default (tool_call_format's, before)


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


def test_parse_text_reads_a_whole_output_as_a_stream_does():
    choice = resolve("llama3_json")
    out = '<|python_tag|>{"name": "get_time", "parameters": {"tz": "UTC"}}'
    content, calls = choice.parse_text(out)
    assert content == "" and [(c.name, c.input) for c in calls] == [("get_time", {"tz": "UTC"})]
    assert run("llama3_json", [out], tools=None) == ("", [("get_time", {"tz": "UTC"})])
    assert choice.parse_text("no call here") == ("no call here", [])
    assert resolve(choice) is choice  # a choice resolves to itself


def test_the_removed_tool_call_format_is_refused_naming_tool_parser():
    from astrai.cli_keys import command_line

    for arg in ("tool_call_format=hermes", "+tool_call_format=[C]|[/C]"):
        with pytest.raises(SystemExit, match="tool_call_format: removed") as err:
            command_line("serve", ["model_path=x", arg])
        assert "tool_parser=<name>" in str(err.value) and "hermes" in str(err.value)
    with pytest.raises(TypeError, match="tool_call_format"):
        ServeSettings(tool_call_format="hermes")  # type: ignore[call-arg]
