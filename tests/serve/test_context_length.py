"""`max_tokens` against the context, over HTTP with the official SDKs.

An explicit `max_tokens` / `max_completion_tokens` that does not fit after the prompt is a
400 in each protocol's error shape naming the field, the context length and the request's
total (as OpenAI and vLLM answer); an omitted one is capped to what fits; the server's
`max_tokens_policy: clamp` generates until the context is full instead.
"""

from __future__ import annotations

import anthropic
import httpx
import openai
import pytest

from astrai.serve import ServerThread, ServeSettings, create_app

HUGE = 100_000
HI = [{"role": "user", "content": "hi"}]
WORD = "self "  # one token of the test tokenizer: a prompt of k words is k + template tokens


@pytest.fixture(scope="module")
def ctx(engine) -> int:
    return engine.max_seq_len


@pytest.fixture
def endless(script):
    """The model never ends its answer by itself: only the context or max_tokens stop it."""
    script("x" * 4000)


def chat_prompt_tokens(oai: openai.OpenAI, messages: list[dict]) -> int:
    reply = oai.chat.completions.create(model="astrai", messages=messages, max_tokens=1)
    return reply.usage.prompt_tokens


def assert_names_both_numbers(message: str, field: str, ctx: int, total: int) -> None:
    assert message.startswith(f"{field}: "), message
    assert f"maximum context length is {ctx} tokens" in message, message
    assert f"{total} were requested" in message, message


# --------------------------------------------------------------------------- the 400
@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("field", ["max_tokens", "max_completion_tokens"])
def test_chat_max_tokens_beyond_the_context_is_a_400(oai, ctx, field, stream):
    prompt = chat_prompt_tokens(oai, HI)
    with pytest.raises(openai.BadRequestError) as info:
        oai.chat.completions.create(model="astrai", messages=HI, stream=stream, **{field: HUGE})
    err = info.value
    assert err.status_code == 400
    assert err.param == field and err.code == "context_length_exceeded"
    assert err.body["type"] == "invalid_request_error"
    assert_names_both_numbers(err.body["message"], field, ctx, prompt + HUGE)


def test_completions_max_tokens_beyond_the_context_is_a_400(oai, ctx):
    ids = [5, 6, 7]
    with pytest.raises(openai.BadRequestError) as info:
        oai.completions.create(model="astrai", prompt=ids, max_tokens=ctx)  # one too many
    err = info.value
    assert err.status_code == 400 and err.param == "max_tokens"
    assert err.code == "context_length_exceeded"
    assert_names_both_numbers(err.body["message"], "max_tokens", ctx, len(ids) + ctx)


def test_completions_names_the_prompt_of_a_batch(oai, ctx):
    short, longer = [5, 6], [5] * (ctx - 4)
    with pytest.raises(openai.BadRequestError) as info:
        oai.completions.create(model="astrai", prompt=[short, longer], max_tokens=8)
    message = info.value.body["message"]
    assert message.startswith("max_tokens: prompt[1]: "), message
    assert f"{len(longer) + 8} were requested" in message


@pytest.mark.parametrize("stream", [False, True])
def test_anthropic_max_tokens_beyond_the_context_is_a_400(ant, ctx, stream):
    prompt = ant.messages.count_tokens(model="astrai", messages=HI).input_tokens
    with pytest.raises(anthropic.BadRequestError) as info:
        reply = ant.messages.create(model="astrai", max_tokens=HUGE, messages=HI, stream=stream)
        list(reply) if stream else None
    err = info.value
    assert err.status_code == 400
    assert err.body["type"] == "error"
    assert err.body["error"]["type"] == "invalid_request_error"
    assert_names_both_numbers(err.body["error"]["message"], "max_tokens", ctx, prompt + HUGE)


def test_a_max_tokens_that_just_fits_answers(oai, ctx, endless):
    prompt = chat_prompt_tokens(oai, HI)
    reply = oai.chat.completions.create(model="astrai", messages=HI, max_tokens=ctx - prompt)
    assert reply.choices[0].finish_reason == "length"
    assert reply.usage.prompt_tokens + reply.usage.completion_tokens == ctx


def test_the_server_keeps_serving_after_a_refusal(oai, script):
    with pytest.raises(openai.BadRequestError):
        oai.chat.completions.create(model="astrai", messages=HI, max_tokens=HUGE)
    script("fine")
    reply = oai.chat.completions.create(model="astrai", messages=HI, max_tokens=8)
    assert reply.choices[0].message.content == "fine"


# --------------------------------------------------------------------------- defaults
def test_an_omitted_max_tokens_is_capped_to_the_context(oai, base_url, ctx, script):
    """Chat's default (2048), Anthropic's (1024) and completions' (16) exceed the room left
    here; the request still answers."""
    script("fine")
    assert ctx < 2048  # the default alone is beyond the context
    reply = oai.chat.completions.create(model="astrai", messages=HI)
    assert reply.choices[0].message.content == "fine"
    body = {"model": "astrai", "messages": HI}  # the anthropic SDK always sends max_tokens
    answer = httpx.post(f"{base_url}/v1/messages", json=body, timeout=60)
    assert answer.status_code == 200, answer.text
    assert answer.json()["content"][0]["text"] == "fine"


def test_an_omitted_completions_max_tokens_stops_at_the_context(oai, ctx, endless):
    ids = [5] * (ctx - 4)  # room for 4 tokens, the default is 16
    reply = oai.completions.create(model="astrai", prompt=ids)
    assert reply.choices[0].finish_reason == "length"
    assert reply.usage.completion_tokens == 4


# --------------------------------------------------------------------------- clamp
@pytest.fixture(scope="module")
def clamp_url(engine):
    settings = ServeSettings(max_tokens_policy="clamp")
    with ServerThread(create_app(engine, settings)) as srv:
        yield srv.url


def test_clamp_policy_generates_until_the_context_is_full(clamp_url, oai, ctx, endless):
    overhead = chat_prompt_tokens(oai, [{"role": "user", "content": WORD * 100}]) - 100
    long = [{"role": "user", "content": WORD * (ctx - overhead - 6)}]  # room for about 6
    with openai.OpenAI(
        base_url=f"{clamp_url}/v1", api_key="x", max_retries=0, timeout=60
    ) as client:
        for field in ("max_tokens", "max_completion_tokens"):
            reply = client.chat.completions.create(model="astrai", messages=long, **{field: HUGE})
            assert reply.choices[0].finish_reason == "length"
            assert reply.usage.prompt_tokens + reply.usage.completion_tokens == ctx
        ids = [5] * (ctx - 3)
        done = client.completions.create(model="astrai", prompt=ids, max_tokens=HUGE)
        assert done.choices[0].finish_reason == "length"
        assert done.usage.completion_tokens == 3
    with anthropic.Anthropic(base_url=clamp_url, api_key="x", max_retries=0, timeout=60) as client:
        message = client.messages.create(model="astrai", max_tokens=HUGE, messages=long)
        assert message.stop_reason == "max_tokens"
        assert message.usage.input_tokens + message.usage.output_tokens == ctx


def test_an_unknown_policy_is_refused():
    with pytest.raises(ValueError, match="max_tokens_policy must be one of clamp, error"):
        ServeSettings(max_tokens_policy="truncate")
