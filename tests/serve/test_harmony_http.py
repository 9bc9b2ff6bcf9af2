"""GPT-OSS's harmony format over HTTP (`reasoning_parser=openai_gptoss`, `tool_parser=openai`,
both picked by `auto` from the chat template), through the real SDKs.

The tokenizer (tests/tiny_parts.py's `harmony_tokenizer`) has harmony's markers as special
tokens, `<|return|>` as its stop token (the server adds `<|call|>`), and a chat template in the shape of
gpt-oss's (a system message with the reasoning effort, a developer message with the tools,
`<|start|>assistant` as the generation prompt).
The scripted model (conftest) writes exact harmony outputs; expected values come from the
script, and the markers (special tokens, which other requests' text leaves out) must never
reach the content.
"""

from __future__ import annotations

import json

import anthropic
import openai
import pytest
from tiny_parts import STDLIB_VOCAB, TINY_SHAPE, harmony_tokenizer, stdlib_texts

from astrai.serve import ServerThread, ServeSettings, create_app
from astrai.serve.openai_builder import OpenAIResponseBuilder
from astrai.serve.reasoning import resolve_reasoning_parser
from astrai.serve.schemas import ChatCompletionRequest
from astrai.tokenizer import AutoTokenizer

MSG = [{"role": "user", "content": "hi"}]
THINK = "The user greets; answer 2 + 2 = 4."
ANSWER = "Hello! It is 4."
CHAT = (
    f"<|channel|>analysis<|message|>{THINK}<|end|>"
    f"<|start|>assistant<|channel|>final<|message|>{ANSWER}<|return|>"
)
ARGS = {"city": "Paris"}
CALL = (
    "<|channel|>analysis<|message|>Need the weather.<|end|><|start|>assistant"
    "<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>"
    + json.dumps(ARGS)
    + "<|call|>"
)
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]


@pytest.fixture(scope="module")
def harmony_dir(tmp_path_factory, save_model_dir):
    tok = harmony_tokenizer(stdlib_texts(), STDLIB_VOCAB, stops=("<|return|>",))
    where = save_model_dir(tmp_path_factory.mktemp("harmony"), tok, **TINY_SHAPE)
    loaded = AutoTokenizer.from_pretrained(where)  # the stop tokens travel with the directory
    return where, loaded


@pytest.fixture(scope="module")
def harmony_engine(harmony_dir, make_scripted_engine):
    where, tok = harmony_dir
    eng = make_scripted_engine(where, tok, "<|return|>")
    yield eng
    eng.shutdown()


@pytest.fixture(scope="module")
def url(harmony_engine):
    settings = ServeSettings(reasoning_parser="auto", tool_parser="auto")
    with ServerThread(create_app(harmony_engine, settings)) as srv:
        yield srv.url


@pytest.fixture
def say(harmony_engine):
    tok = harmony_engine.tokenizer

    def set_script(text: str) -> None:
        harmony_engine.model.script = tok.encode(text)

    yield set_script
    harmony_engine.model.script = None


def _oai(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=60)


def _both(url: str, **kw):
    with _oai(url) as c:
        plain = c.chat.completions.create(model="m", messages=MSG, temperature=0, **kw)
        chunks = list(
            c.chat.completions.create(
                model="m",
                messages=MSG,
                temperature=0,
                stream=True,
                stream_options={"include_usage": True},
                **kw,
            )
        )
    return plain, chunks


def _joined(chunks, field: str) -> str:
    return "".join(getattr(ch.choices[0].delta, field, None) or "" for ch in chunks if ch.choices)


def test_auto_reads_harmony_off_the_template(harmony_engine):
    tok = harmony_engine.tokenizer
    assert resolve_reasoning_parser("auto", tok) == "openai_gptoss"
    app = create_app(harmony_engine, ServeSettings(reasoning_parser="auto", tool_parser="auto"))
    assert app.state.astrai.tool_parser.name == "openai"


def test_the_openai_tool_parser_needs_the_harmony_reasoning_parser(engine):
    """Refused in the settings (before any model loads), and for `auto` once the template
    is known (the suite's ChatML template is no harmony template)."""
    need = r"tool_parser=openai .* needs reasoning_parser=openai_gptoss"
    with pytest.raises(ValueError, match=need):
        ServeSettings(tool_parser="openai")
    settings = ServeSettings(tool_parser="openai", reasoning_parser="auto")
    with pytest.raises(ValueError, match=need):
        create_app(engine, settings)


def test_reasoning_and_answer_plain_and_streamed(url, say, harmony_engine):
    say(CHAT)
    plain, chunks = _both(url, max_tokens=200)
    msg = plain.choices[0].message
    assert msg.content == ANSWER and msg.reasoning_content == THINK
    assert plain.choices[0].finish_reason == "stop"
    assert _joined(chunks, "content") == ANSWER
    assert _joined(chunks, "reasoning_content") == THINK
    # the reasoning's tokens: through its <|end|>
    tok = harmony_engine.tokenizer
    want = len(tok.encode(CHAT[: CHAT.index("<|end|>") + len("<|end|>")]))
    assert plain.usage.completion_tokens_details.reasoning_tokens == want
    assert chunks[-1].usage.completion_tokens_details.reasoning_tokens == want


def test_a_tool_call_plain_and_streamed(url, say, harmony_engine):
    say(CALL)
    plain, chunks = _both(url, max_tokens=200, tools=TOOLS)
    choice = plain.choices[0]
    assert choice.finish_reason == "tool_calls"
    # generation stopped at <|call|> (the tokenizer's own stops name only <|return|>)
    tok = harmony_engine.tokenizer
    assert tok.token_to_id("<|call|>") not in tok.stop_ids
    assert plain.usage.completion_tokens == len(tok.encode(CALL))
    assert not choice.message.content
    assert choice.message.reasoning_content == "Need the weather."
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == ARGS
    streamed = [tc for ch in chunks if ch.choices for tc in ch.choices[0].delta.tool_calls or []]
    assert streamed and streamed[0].function.name == "get_weather"
    assert json.loads("".join(tc.function.arguments or "" for tc in streamed)) == ARGS
    assert not _joined(chunks, "content")
    # the call and its result go back into the conversation through the template
    follow = [
        *MSG,
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": '{"temp": 21}'},
    ]
    say(CHAT)
    with _oai(url) as c:
        again = c.chat.completions.create(
            model="m", messages=follow, tools=TOOLS, temperature=0, max_tokens=200
        )
    assert again.choices[0].message.content == ANSWER


def test_a_json_answer_after_the_reasoning(url, say):
    answer = '{"answer": 4}'
    say(CHAT.replace(ANSWER, answer))
    schema = {
        "type": "object",
        "properties": {"answer": {"type": "integer"}},
        "required": ["answer"],
        "additionalProperties": False,
    }
    fmt = {"type": "json_schema", "json_schema": {"name": "a", "schema": schema}}
    with _oai(url) as c:
        out = c.chat.completions.create(
            model="m", messages=MSG, temperature=0, max_tokens=200, response_format=fmt
        )
    msg = out.choices[0].message
    assert msg.reasoning_content == THINK and json.loads(msg.content) == {"answer": 4}


def test_anthropic_thinking_and_the_responses_api(url, say):
    say(CHAT)
    with anthropic.Anthropic(base_url=url, api_key="x", max_retries=0, timeout=60) as c:
        out = c.messages.create(
            model="m",
            max_tokens=200,
            messages=MSG,
            thinking={"type": "enabled", "budget_tokens": 150},
        )
    assert [b.type for b in out.content] == ["thinking", "text"]
    assert out.content[0].thinking == THINK and out.content[1].text == ANSWER
    with _oai(url) as c:
        resp = c.responses.create(model="m", input="hi", reasoning={"effort": "low"})
    kinds = [item.type for item in resp.output]
    assert kinds == ["reasoning", "message"]
    assert resp.output[0].content[0].text == THINK
    assert resp.output_text == ANSWER


def test_reasoning_effort_reaches_the_template(harmony_engine):
    tok = harmony_engine.tokenizer
    body = ChatCompletionRequest(model="m", messages=MSG, reasoning_effort="high")
    settings = ServeSettings(reasoning_parser="openai_gptoss")
    prepared = OpenAIResponseBuilder().prepare(body, tok, settings)
    prompt = tok.decode(prepared.prompts[0])
    assert "Reasoning: high" in prompt and prompt.endswith("<|start|>assistant")
    assert prepared.params.skip_special_tokens is False
    assert tok.token_to_id("<|call|>") in prepared.params.stop_ids
    assert set(tok.stop_ids) <= prepared.params.stop_ids
    plain = OpenAIResponseBuilder().prepare(
        ChatCompletionRequest(model="m", messages=MSG), tok, ServeSettings()
    )
    assert "Reasoning: medium" in tok.decode(plain.prompts[0])
