"""Reasoning parsers over HTTP (`reasoning_parser=qwen3|deepseek_r1`), through the real SDKs.

The scripted model (conftest) writes an exact text; the test tokenizer's default ChatML
template does not open ``<think>`` in the prompt, so for ``qwen3`` the reasoning is there
only when the output starts with ``<think>`` or has a ``</think>`` (split there, as Qwen3's
model card splits), while ``deepseek_r1`` reads everything up to ``</think>`` as
reasoning. Expected values are derived from the script text with the
tokenizer, never hard-coded.
"""

from __future__ import annotations

import json

import anthropic
import openai
import pytest

from astrai.serve import ServerThread, ServeSettings, create_app

MSG = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module", params=["qwen3", "deepseek_r1"])
def parser_url(request, engine):
    with ServerThread(create_app(engine, ServeSettings(reasoning_parser=request.param))) as srv:
        yield request.param, srv.url


@pytest.fixture(scope="module")
def qwen3_url(engine):
    with ServerThread(create_app(engine, ServeSettings(reasoning_parser="qwen3"))) as srv:
        yield srv.url


def _oai(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=60)


def _ant(url: str) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=url, api_key="x", max_retries=0, timeout=60)


def _expected(parser: str, script: str) -> tuple[str, str, str]:
    """(reasoning, content, raw reasoning through the end tag) as the parser defines."""
    body = script.removeprefix("<think>") if parser == "deepseek_r1" else script
    if parser == "qwen3" and not script.startswith("<think>") and "</think>" not in script:
        return "", script, ""  # qwen3 without any tag: all answer (Qwen3's model card)
    body = body.removeprefix("<think>")
    reasoning, _, content = body.partition("</think>")
    end = script.find("</think>")
    raw = script if end < 0 else script[: end + len("</think>")]
    return reasoning, content.lstrip(), raw


def _openai_both(url: str, **kw):
    with _oai(url) as c:
        plain = c.chat.completions.create(model="m", messages=MSG, **kw)
        chunks = list(
            c.chat.completions.create(
                model="m", messages=MSG, stream=True, stream_options={"include_usage": True}, **kw
            )
        )
    return plain, chunks


def _joined(chunks, field: str) -> str:
    return "".join(getattr(ch.choices[0].delta, field, None) or "" for ch in chunks if ch.choices)


SCRIPTS = [
    "<think>Let me add 2 and 2.\nIt is 4.</think>\n\nThe answer is 4.",
    "Plain answer, no thinking at all.",
    "Reasoning without the tag.</think>Then the answer.",
]


@pytest.mark.parametrize("text", SCRIPTS)
def test_openai_reasoning_plain_and_streamed(parser_url, script, tokenizer, text):
    parser, url = parser_url
    script(text)
    plain, chunks = _openai_both(url, max_tokens=200, temperature=0)
    reasoning, content, raw = _expected(parser, text)
    msg = plain.choices[0].message
    assert msg.content == content
    assert (getattr(msg, "reasoning_content", None) or "") == reasoning
    if reasoning:  # the thinking and its tags never leak into the content
        assert "think>" not in msg.content and reasoning not in msg.content
    assert plain.choices[0].finish_reason == "stop"
    # Streamed deltas concatenate to the plain result; the thinking never in `content`.
    assert _joined(chunks, "content") == content
    assert _joined(chunks, "reasoning_content") == reasoning
    want = len(tokenizer.encode(raw)) if raw else 0
    assert plain.usage.completion_tokens_details.reasoning_tokens == want
    assert chunks[-1].usage.completion_tokens_details.reasoning_tokens == want
    assert plain.usage.completion_tokens == chunks[-1].usage.completion_tokens


@pytest.mark.parametrize("text", SCRIPTS[:1] + SCRIPTS[2:])
def test_anthropic_thinking_blocks_plain_and_streamed(parser_url, script, text):
    parser, url = parser_url
    script(text)
    reasoning, content, _ = _expected(parser, text)
    kw = dict(model="m", max_tokens=200, messages=MSG)
    kw["thinking"] = {"type": "enabled", "budget_tokens": 150}
    with _ant(url) as c:
        plain = c.messages.create(**kw)
        with c.messages.stream(**kw) as s:
            events = list(s)
            final = s.get_final_message()
    types = [b.type for b in plain.content]
    if reasoning:
        assert types == ["thinking", "text"]
        assert plain.content[0].thinking == reasoning
        assert isinstance(plain.content[0].signature, str)
    else:
        assert types == ["text"]
    assert plain.content[-1].text == content
    assert plain.stop_reason == "end_turn"
    assert [b.model_dump() for b in final.content] == [b.model_dump() for b in plain.content]
    if reasoning:  # the event sequence of a thinking block, before the text block
        kinds = [
            (e.type, getattr(getattr(e, "content_block", None), "type", None))
            for e in events
            if e.type.startswith("content_block") or e.type in ("thinking", "signature")
        ]
        assert kinds[0] == ("content_block_start", "thinking")
        sig = kinds.index(("signature", None))
        stop = next(i for i, k in enumerate(kinds) if k[0] == "content_block_stop")
        text = kinds.index(("content_block_start", "text"))
        assert 0 < kinds.index(("thinking", None)) < sig < stop < text


def test_unclosed_think_is_reasoning_with_the_protocols_finish(parser_url, script, tokenizer):
    """Hostile output: `<think>` never closed. vLLM's parsers read it as a reasoning cut
    short: all of it is reasoning, the content empty; a 200 with the engine's finish."""
    _, url = parser_url
    text = "<think>never closed, going on and on"
    script(text)
    plain, chunks = _openai_both(url, max_tokens=200, temperature=0)
    msg = plain.choices[0].message
    assert msg.reasoning_content == "never closed, going on and on"
    assert msg.content == "" and _joined(chunks, "content") == ""
    assert plain.choices[0].finish_reason == "stop"
    assert _joined(chunks, "reasoning_content") == msg.reasoning_content
    assert plain.usage.completion_tokens_details.reasoning_tokens == len(tokenizer.encode(text))
    cut, _ = _openai_both(url, max_tokens=4, temperature=0)
    assert cut.choices[0].finish_reason == "length"
    assert "<think" not in (cut.choices[0].message.content or "")
    with _ant(url) as c:
        out = c.messages.create(
            model="m",
            max_tokens=200,
            messages=MSG,
            thinking={"type": "enabled", "budget_tokens": 150},
        )
    assert out.stop_reason == "end_turn"
    assert [b.type for b in out.content] == ["thinking"]
    assert out.content[0].thinking == msg.reasoning_content


def test_stop_strings_and_tool_calls_apply_after_the_reasoning(parser_url, script):
    _, url = parser_url
    call = '<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>'
    script(f"<think>maybe STOP here, or {call}</think>Answer STOP tail")
    plain, _ = _openai_both(url, max_tokens=200, temperature=0, stop=["STOP"])
    msg = plain.choices[0].message
    assert msg.reasoning_content == f"maybe STOP here, or {call}"
    assert msg.content == "Answer "
    assert not msg.tool_calls
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    script(f"<think>I should call f.</think>{call}")
    with _oai(url) as c:
        out = c.chat.completions.create(model="m", messages=MSG, tools=tools, max_tokens=200)
    assert out.choices[0].finish_reason == "tool_calls"
    assert out.choices[0].message.reasoning_content == "I should call f."
    assert json.loads(out.choices[0].message.tool_calls[0].function.arguments) == {"x": 1}


def test_enable_thinking_false_parses_nothing(qwen3_url, script):
    """qwen3 with `chat_template_kwargs: {enable_thinking: false}`: the template writes an
    empty think block, the model answers plainly, nothing is read as reasoning."""
    text = "<think>not thinking</think>answer"
    script(text)
    with _oai(qwen3_url) as c:
        out = c.chat.completions.create(
            model="m",
            messages=MSG,
            max_tokens=200,
            extra_body={"chat_template_kwargs": {"enable_thinking": False}},
        )
        bad = None
        try:
            c.chat.completions.create(
                model="m", messages=MSG, extra_body={"chat_template_kwargs": {"tools": []}}
            )
        except openai.BadRequestError as err:
            bad = err
    assert out.choices[0].message.content == text
    assert getattr(out.choices[0].message, "reasoning_content", None) is None
    assert bad is not None and "chat_template_kwargs" in str(bad)


def test_structured_output_applies_after_the_reasoning(parser_url, script):
    _, url = parser_url
    answer = '{"a": 1}'
    script(f"<think>think {{not json}}</think>{answer}")
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    fmt = {"type": "json_schema", "json_schema": {"name": "r", "schema": schema}}
    plain, chunks = _openai_both(url, max_tokens=200, temperature=0, response_format=fmt)
    msg = plain.choices[0].message
    assert msg.reasoning_content == "think {not json}"
    assert json.loads(msg.content) == {"a": 1}
    assert _joined(chunks, "content") == msg.content


def test_budget_tokens_caps_the_thinking(parser_url, script, tokenizer):
    """Past `budget_tokens` the closing tag is forced: the thinking ends within the budget
    and the model goes on with its answer."""
    _, url = parser_url
    long = " ".join(f"step {i}" for i in range(40))
    script(f"<think>{long}</think>Done.")
    budget = 8
    with _ant(url) as c:
        out = c.messages.create(
            model="m",
            max_tokens=300,
            messages=MSG,
            thinking={"type": "enabled", "budget_tokens": budget},
        )
        with pytest.raises(anthropic.BadRequestError, match="budget_tokens"):
            c.messages.create(
                model="m",
                max_tokens=10,
                messages=MSG,
                thinking={"type": "enabled", "budget_tokens": 10},
            )
        with pytest.raises(anthropic.BadRequestError, match="budget_tokens"):
            c.messages.create(model="m", max_tokens=10, messages=MSG, thinking={"type": "enabled"})
    assert [b.type for b in out.content] == ["thinking", "text"]
    thought = out.content[0].thinking
    assert long.startswith(thought) and len(thought) < len(long)
    assert len(tokenizer.encode(f"<think>{thought}</think>")) <= budget
    assert out.content[1].text  # the answer goes on after the forced close


def test_thinking_blocks_sent_back_are_accepted_and_not_rendered(parser_url, script):
    """A client sends the thinking block back in the history (Anthropic requires it with
    tools): accepted, and the prompt is the same as without it."""
    _, url = parser_url
    script("<think>ok</think>fine")
    turn = [
        {"type": "thinking", "thinking": "earlier thoughts", "signature": ""},
        {"type": "redacted_thinking", "data": "opaque"},
        {"type": "text", "text": "Hello."},
    ]
    history = [*MSG, {"role": "assistant", "content": turn}, {"role": "user", "content": "and?"}]
    plain = [*MSG, {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "and?"}]
    thinking = {"type": "enabled", "budget_tokens": 100}
    with _ant(url) as c:
        out = c.messages.create(model="m", max_tokens=200, messages=history, thinking=thinking)
        counted = c.messages.count_tokens(model="m", messages=history, thinking=thinking)
        without = c.messages.count_tokens(model="m", messages=plain, thinking=thinking)
    assert [b.type for b in out.content] == ["thinking", "text"]
    assert out.usage.input_tokens == counted.input_tokens == without.input_tokens


def test_anthropic_thinking_then_tool_use_streamed_as_plain(parser_url, script):
    _, url = parser_url
    call = '<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>'
    script(f"<think>I should call f.</think>{call}")
    tools = [{"name": "f", "input_schema": {"type": "object"}}]
    kw = dict(model="m", max_tokens=200, messages=MSG, tools=tools)
    kw["thinking"] = {"type": "enabled", "budget_tokens": 100}
    with _ant(url) as c:
        plain = c.messages.create(**kw)
        with c.messages.stream(**kw) as s:
            final = s.get_final_message()
    assert [b.type for b in plain.content] == ["thinking", "tool_use"]
    assert plain.content[0].thinking == "I should call f."
    assert plain.content[1].input == {"x": 1} and plain.stop_reason == "tool_use"
    strip = [{k: v for k, v in b.model_dump().items() if k != "id"} for b in final.content]
    assert strip == [{k: v for k, v in b.model_dump().items() if k != "id"} for b in plain.content]
