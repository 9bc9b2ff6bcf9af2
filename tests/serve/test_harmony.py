"""GPT-OSS's harmony output split into reasoning, answer and tool calls
(`astrai.serve.harmony.HarmonySplitter`), the parsers `auto` picks from a harmony template,
and the `openai` tool parser reading the calls the splitter hands on.

Every output is fed whole and in pieces of 1, 2, 3 and 7 characters: the pieces must add up
to the same split (markers cut anywhere are held back, never leaked)."""

from __future__ import annotations

import json

import pytest

from astrai.serve import harmony
from astrai.serve.harmony import HarmonySplitter, read_header, tool_call_text
from astrai.serve.tool_parsers import detect, resolve

CALL_ARGS = {"city": "Paris", "unit": "celsius"}
# (output, reasoning, content: text or the calls' (name, arguments), reasoned)
CASES = {
    "reasoning then answer": (
        "<|channel|>analysis<|message|>2 + 2 is 4.<|end|>"
        "<|start|>assistant<|channel|>final<|message|>It is 4.<|return|>",
        "2 + 2 is 4.",
        "It is 4.",
        True,
    ),
    "recipient in the channel part": (
        "<|channel|>analysis<|message|>Need the weather.<|end|><|start|>assistant"
        "<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>"
        + json.dumps(CALL_ARGS)
        + "<|call|>",
        "Need the weather.",
        [("get_weather", CALL_ARGS)],
        True,
    ),
    "recipient in the role part": (
        " to=functions.get_weather<|channel|>commentary json<|message|>"
        + json.dumps(CALL_ARGS)
        + "<|call|>",
        "",
        [("get_weather", CALL_ARGS)],
        False,
    ),
    "a preamble before the call is content": (
        "<|channel|>commentary<|message|>Checking.<|end|><|start|>assistant"
        "<|channel|>commentary to=functions.get_weather<|message|>{}<|call|>",
        "",
        "Checking." + tool_call_text("functions.get_weather", "{}"),
        False,
    ),
    "a stop marker after a message's end is no text": (
        "<|channel|>final<|message|>Done.<|end|><|return|>"
        "<|start|>assistant<|channel|>final<|message|> More.",
        "",
        "Done. More.",
        False,
    ),
    "no header: all answer": ("A plain answer <| with a stray bracket.", "", None, False),
    "reasoning that never ends": (
        "<|channel|>analysis<|message|>Still thin",
        "Still thin",
        "",
        True,
    ),
    "two analysis messages": (
        "<|channel|>analysis<|message|>One.<|end|><|start|>assistant<|channel|>analysis"
        "<|message|> Two.<|end|><|start|>assistant<|channel|>final<|message|>Done",
        "One. Two.",
        "Done",
        True,
    ),
}


def _split(text: str, step: int | None) -> tuple[str, str, HarmonySplitter]:
    sp = HarmonySplitter()
    pieces = []
    chunks = [text] if step is None else [text[i : i + step] for i in range(0, len(text), step)]
    for chunk in chunks:
        pieces += sp.feed(chunk)
    pieces += sp.flush()
    reasoning = "".join(t for r, t in pieces if r)
    content = "".join(t for r, t in pieces if not r)
    return reasoning, content, sp


@pytest.mark.parametrize("case", CASES)
def test_outputs_split_alike_whole_and_in_pieces(case):
    text, reasoning, content, reasoned = CASES[case]
    if content is None:
        content = text
    if isinstance(content, list):
        content = "".join(tool_call_text("functions." + n, json.dumps(a)) for n, a in content)
    for step in (None, 1, 2, 3, 7):
        got_reasoning, got_content, sp = _split(text, step)
        assert (got_reasoning, got_content) == (reasoning, content), (case, step)
        assert sp.reasoned is reasoned
        for marker in ("<|channel|>", "<|message|>", "<|end|>", "<|call|>", "<|return|>"):
            assert marker not in got_content + got_reasoning


def test_the_reasoning_ends_at_its_end_marker():
    text = CASES["reasoning then answer"][0]
    _, _, sp = _split(text, 3)
    assert sp.end_at == text.index("<|end|>") + len("<|end|>")
    _, _, never = _split(CASES["reasoning that never ends"][0], 3)
    assert never.reasoned and never.end_at is None


def test_headers_name_channel_and_recipient():
    assert read_header("<|channel|>analysis") == ("analysis", "")
    assert read_header("<|channel|>commentary to=functions.f <|constrain|>json") == (
        "commentary",
        "functions.f",
    )
    assert read_header(" to=functions.f<|channel|>commentary json") == ("commentary", "functions.f")
    assert read_header("") == ("", "")


def test_calls_reach_the_openai_parser_and_bad_arguments_stay_text():
    parser = resolve("openai").new([{"name": "get_weather", "parameters": {}}])
    text = tool_call_text("functions.get_weather", json.dumps(CALL_ARGS))
    events = parser.feed(text) + parser.flush()
    (call,) = parser.calls
    assert events == [call]
    assert (call.name, json.loads(call.arguments)) == ("get_weather", CALL_ARGS)
    bad = resolve("openai").new([{"name": "get_weather", "parameters": {}}])
    broken = tool_call_text("functions.get_weather", '{"city": ')
    events = bad.feed(broken) + bad.flush()
    assert not bad.calls and "".join(e.text for e in events) == broken


def test_auto_picks_the_openai_parser_for_a_harmony_template():
    template = '{{- "<|start|>assistant<|channel|>final<|message|>" }}'
    assert detect(template) == "openai"
    assert detect("{{ '<tool_call>' }}") == "hermes"
    assert harmony.TEMPLATE_MARKER in template
