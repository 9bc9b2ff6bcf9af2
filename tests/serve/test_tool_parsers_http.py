"""Every tool parser through the real openai and anthropic SDKs, over real HTTP.

A server per parser (`tool_parser=<name>`) on the scripted tiny model: the model answers
exactly the scripted text in that parser's format. For each protocol the streamed deltas
concatenate to the non-streamed answer, arguments parse as JSON and validate against the
tool's schema (`jsonschema`), `tool_choice` none / required / named behave, and hostile
output is a 200 whose text is the content.
"""

from __future__ import annotations

import json

import anthropic
import jsonschema
import openai
import pytest
from tool_parser_cases import (
    ANT_TOOLS,
    CALL_A,
    CALL_B,
    CALLS_ONLY,
    MSGS,
    OAI_TOOLS,
    PARSERS,
    REFERENCE_CASES,
    SCHEMAS,
    hostile,
    spell,
)

from astrai.serve import ServerThread, ServeSettings, create_app


@pytest.fixture(scope="module", params=PARSERS)
def parser_server(request, engine):
    with ServerThread(create_app(engine, ServeSettings(tool_parser=request.param))) as srv:
        yield request.param, srv.url


@pytest.fixture
def clients(parser_server):
    name, url = parser_server
    with (
        openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=60) as oai,
        anthropic.Anthropic(base_url=url, api_key="x", max_retries=0, timeout=60) as ant,
    ):
        yield name, oai, ant


def _cases(parser: str) -> list[tuple[str, list]]:
    content = "" if parser in CALLS_ONLY else "Let me check."
    return [(content, [CALL_A]), ("", [CALL_A, CALL_B])]


def _oai_plain(oai, **kw) -> tuple[str, list[tuple[str, str]], str]:
    r = oai.chat.completions.create(model="astrai", messages=MSGS, **kw)
    c = r.choices[0]
    calls = [(t.function.name, t.function.arguments) for t in c.message.tool_calls or []]
    assert all(t.id.startswith("call_") for t in c.message.tool_calls or [])
    return c.message.content or "", calls, c.finish_reason


def _oai_stream(oai, **kw) -> tuple[str, list[tuple[str, str]], str]:
    text, calls, finish, pieces = "", {}, None, {}
    for chunk in oai.chat.completions.create(model="astrai", messages=MSGS, stream=True, **kw):
        for c in chunk.choices:
            text += c.delta.content or ""
            for d in c.delta.tool_calls or []:
                if d.index not in calls:  # the first delta of a call: its id, type and name
                    assert d.id and d.type == "function" and d.function.name
                    calls[d.index] = [d.function.name, ""]
                else:
                    assert d.id is None and d.function.name is None
                calls[d.index][1] += d.function.arguments or ""
                pieces[d.index] = pieces.get(d.index, 0) + bool(d.function.arguments)
            finish = c.finish_reason or finish
    for i, (_, args) in calls.items():  # arguments come in fragments, as OpenAI sends them
        assert pieces[i] >= 2 * len(json.loads(args)), (pieces[i], args)
    return text, [tuple(calls[i]) for i in sorted(calls)], finish


def _ant_plain(ant, **kw) -> tuple[str, list[tuple[str, dict]], str]:
    m = ant.messages.create(model="astrai", messages=MSGS, max_tokens=240, **kw)
    text = "".join(b.text for b in m.content if b.type == "text")
    calls = [(b.name, b.input) for b in m.content if b.type == "tool_use"]
    assert all(b.id.startswith("toolu_") for b in m.content if b.type == "tool_use")
    return text, calls, m.stop_reason


def _ant_stream(ant, **kw) -> tuple[str, list[tuple[str, dict]], str]:
    text, blocks, stop, pieces = "", {}, None, {}
    with ant.messages.stream(model="astrai", messages=MSGS, max_tokens=240, **kw) as stream:
        for ev in stream:
            if ev.type == "content_block_start" and ev.content_block.type == "tool_use":
                blocks[ev.index] = [ev.content_block.name, ""]
            elif ev.type == "content_block_delta" and ev.delta.type == "text_delta":
                text += ev.delta.text
            elif ev.type == "content_block_delta" and ev.delta.type == "input_json_delta":
                blocks[ev.index][1] += ev.delta.partial_json
                pieces[ev.index] = pieces.get(ev.index, 0) + 1
            elif ev.type == "message_delta":
                stop = ev.delta.stop_reason
        final = stream.get_final_message()
    calls = [(blocks[i][0], json.loads(blocks[i][1])) for i in sorted(blocks)]
    for i in blocks:  # arguments come in fragments: at least a key and a value each
        assert pieces[i] >= 2 * len(json.loads(blocks[i][1])), (pieces[i], blocks[i])
    assert [(b.name, b.input) for b in final.content if b.type == "tool_use"] == calls
    return text, calls, stop


def _check_args(calls: list[tuple[str, dict]]) -> None:
    for name, args in calls:
        jsonschema.validate(args, SCHEMAS[name])


def test_openai_calls_plain_equals_stream(clients, script):
    parser, oai, _ = clients
    for content, calls in _cases(parser):
        script(spell(parser, calls, content))
        plain = _oai_plain(oai, tools=OAI_TOOLS)
        streamed = _oai_stream(oai, tools=OAI_TOOLS)
        assert streamed == plain
        text, got, finish = plain
        assert finish == "tool_calls" and text == content
        parsed = [(n, json.loads(a)) for n, a in got]
        assert parsed == calls
        _check_args(parsed)
        with oai.chat.completions.stream(model="astrai", messages=MSGS, tools=OAI_TOOLS) as s:
            final = s.get_final_completion().choices[0].message
        assert [(t.function.name, t.function.arguments) for t in final.tool_calls] == got


def test_anthropic_calls_plain_equals_stream(clients, script):
    parser, _, ant = clients
    for content, calls in _cases(parser):
        script(spell(parser, calls, content))
        plain = _ant_plain(ant, tools=ANT_TOOLS)
        assert _ant_stream(ant, tools=ANT_TOOLS) == plain
        text, got, stop = plain
        assert stop == "tool_use" and text == content and got == calls
        _check_args(got)


def test_tool_choice_none_and_no_tools_give_text(clients, script):
    parser, oai, ant = clients
    out = spell(parser, [CALL_A])
    script(out)
    for kw in ({}, {"tools": OAI_TOOLS, "tool_choice": "none"}):
        assert _oai_plain(oai, **kw) == (out, [], "stop")
        assert _oai_stream(oai, **kw) == (out, [], "stop")
    for kw in ({}, {"tools": ANT_TOOLS, "tool_choice": {"type": "none"}}):
        assert _ant_plain(ant, **kw) == (out, [], "end_turn")
        assert _ant_stream(ant, **kw) == (out, [], "end_turn")


def test_forced_tool_choice_is_read_back(clients):
    """required / named (OpenAI), any / tool (Anthropic): the grammar writes the parser's
    forced spelling, unscripted (the tiny model samples under the mask)."""
    parser, oai, ant = clients
    named = {"type": "function", "function": {"name": "get_time"}}
    for choice, want in (("required", None), (named, "get_time")):
        for run in (_oai_plain, _oai_stream):
            _, calls, finish = run(oai, tools=OAI_TOOLS, tool_choice=choice, max_tokens=240)
            assert finish == "tool_calls", (parser, choice)
            [(name, args)] = calls
            assert want in (None, name)
            _check_args([(name, json.loads(args))])
    for choice, want in (
        ({"type": "any"}, None),
        ({"type": "tool", "name": "get_time"}, "get_time"),
    ):
        for run in (_ant_plain, _ant_stream):
            _, calls, stop = run(ant, tools=ANT_TOOLS, tool_choice=choice)
            assert stop == "tool_use", (parser, choice)
            [(name, args)] = calls
            assert want in (None, name)
            _check_args(calls)


def test_hostile_output_is_content_never_an_error(clients, script):
    parser, oai, ant = clients
    for text in hostile(parser):
        script(text)
        assert _oai_plain(oai, tools=OAI_TOOLS) == (text, [], "stop"), text
        assert _oai_stream(oai, tools=OAI_TOOLS) == (text, [], "stop"), text
        assert _ant_plain(ant, tools=ANT_TOOLS) == (text, [], "end_turn"), text
        assert _ant_stream(ant, tools=ANT_TOOLS) == (text, [], "end_turn"), text


@pytest.mark.parametrize(("parser", "tools", "out", "want"), REFERENCE_CASES)
def test_reference_readings_over_http_plain_and_streamed(engine, script, parser, tools, out, want):
    """The four outputs the family reference parsers read otherwise than astrai did
    (#44.12), through both SDKs: the same reading, plain and streamed."""
    content, calls = want
    oai_tools = [{"type": "function", "function": t} for t in tools]
    ant_tools = [{"name": t["name"], "input_schema": t["parameters"]} for t in tools]
    script(out)
    with (
        ServerThread(create_app(engine, ServeSettings(tool_parser=parser))) as srv,
        openai.OpenAI(base_url=f"{srv.url}/v1", api_key="x", max_retries=0, timeout=60) as oai,
        anthropic.Anthropic(base_url=srv.url, api_key="x", max_retries=0, timeout=60) as ant,
    ):
        for run in (_oai_plain, _oai_stream):
            text, got, finish = run(oai, tools=oai_tools, max_tokens=240)
            assert (text, [(n, json.loads(a)) for n, a in got]) == want
            assert finish == ("tool_calls" if calls else "stop")
        for run in (_ant_plain, _ant_stream):
            assert run(ant, tools=ant_tools) == (
                content,
                calls,
                "tool_use" if calls else "end_turn",
            )
