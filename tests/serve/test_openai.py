"""The official `openai` SDK against the server: create/stream, sync/async, helpers."""

import asyncio

import openai
import pytest

MSGS = [{"role": "user", "content": "Say hello"}]
TEXT = "Hello there, how are you today?"


def test_create_plain(oai, script):
    script(TEXT)
    r = oai.chat.completions.create(model="astrai", messages=MSGS, max_tokens=64)
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-")
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == TEXT
    assert r.choices[0].finish_reason == "stop"
    u = r.usage
    assert u.prompt_tokens > 0 and u.completion_tokens > 0
    assert u.total_tokens == u.prompt_tokens + u.completion_tokens


def test_stream_sync_with_usage(oai, script, tokenizer):
    script(TEXT)
    chunks = list(
        oai.chat.completions.create(
            model="astrai",
            messages=MSGS,
            max_tokens=64,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == TEXT
    finish = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert [c.choices[0].finish_reason for c in finish] == ["stop"]
    assert finish[0].usage is not None  # the finish chunk carries usage
    last = chunks[-1]
    assert last.choices == [] and last.usage.completion_tokens == len(tokenizer.encode(TEXT)) + 1


def test_stream_helper_final_completion(oai, script):
    script(TEXT)
    with oai.chat.completions.stream(
        model="astrai", messages=MSGS, max_tokens=64, stream_options={"include_usage": True}
    ) as stream:
        deltas = [e.delta for e in stream if e.type == "content.delta"]
        final = stream.get_final_completion()
    assert "".join(deltas) == TEXT
    assert final.choices[0].message.content == TEXT
    assert final.choices[0].finish_reason == "stop"
    assert final.usage.total_tokens == final.usage.prompt_tokens + final.usage.completion_tokens


def test_async_create_and_stream(aoai, script):
    script(TEXT)

    async def go():
        r = await aoai.chat.completions.create(model="astrai", messages=MSGS, max_tokens=64)
        stream = await aoai.chat.completions.create(
            model="astrai", messages=MSGS, max_tokens=64, stream=True
        )
        parts = [c.choices[0].delta.content or "" async for c in stream if c.choices]
        async with aoai.chat.completions.stream(model="astrai", messages=MSGS, max_tokens=64) as s:
            final = await s.get_final_completion()
        await aoai.close()
        return r, "".join(parts), final

    r, streamed, final = asyncio.run(go())
    assert r.choices[0].message.content == streamed == TEXT
    assert final.choices[0].message.content == TEXT


def test_n_choices(oai, script):
    script(TEXT)
    r = oai.chat.completions.create(model="astrai", messages=MSGS, max_tokens=64, n=2)
    assert [c.index for c in r.choices] == [0, 1]
    assert all(c.message.content == TEXT for c in r.choices)
    assert r.usage.completion_tokens == 2 * (r.usage.completion_tokens // 2)
    texts = {0: "", 1: ""}
    for c in oai.chat.completions.create(
        model="astrai", messages=MSGS, max_tokens=64, n=2, stream=True
    ):
        for ch in c.choices:
            texts[ch.index] += ch.delta.content or ""
    assert texts == {0: TEXT, 1: TEXT}


def test_n_sampled_choices_differ(oai):
    r = oai.chat.completions.create(
        model="astrai", messages=MSGS, max_tokens=12, n=2, seed=1, temperature=1.5
    )
    a, b = (c.message.content for c in r.choices)
    assert a != b  # seeds seed, seed + 1


@pytest.mark.parametrize("stream", [False, True])
def test_stop(oai, script, stream):
    script(TEXT)
    kwargs = dict(model="astrai", messages=MSGS, max_tokens=64, stop=["how", "xyz"])
    if stream:
        chunks = list(oai.chat.completions.create(stream=True, **kwargs))
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        reason = [c.choices[0].finish_reason for c in chunks if c.choices][-1]
    else:
        r = oai.chat.completions.create(**kwargs)
        text, reason = r.choices[0].message.content, r.choices[0].finish_reason
    assert text == "Hello there, "
    assert reason == "stop"


def test_stop_cancels_the_task(oai, script, engine):
    script("start" + " word" * 200)
    before = engine.get_stats()["total_tokens"]
    r = oai.chat.completions.create(model="astrai", messages=MSGS, max_tokens=400, stop="word word")
    assert r.choices[0].message.content == "start "
    assert engine.get_stats()["total_tokens"] - before < 50  # not 400: cancelled


def test_max_tokens_length(oai, script):
    script(TEXT)
    r = oai.chat.completions.create(model="astrai", messages=MSGS, max_tokens=3)
    assert r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 3


def test_temperature_zero_is_greedy_and_logit_bias(oai, tokenizer):
    a_id = tokenizer.encode("A")[0]
    kwargs = dict(model="astrai", messages=MSGS, max_tokens=6, temperature=0)
    r1 = oai.chat.completions.create(**kwargs, logit_bias={str(a_id): 100})
    assert r1.choices[0].message.content == "A" * 6
    outs = {
        oai.chat.completions.create(**kwargs, seed=s).choices[0].message.content for s in (1, 2)
    }
    assert len(outs) == 1  # greedy: the seed does not matter


def test_penalties_change_the_output(oai, tokenizer):
    a_id = tokenizer.encode("A")[0]
    base = dict(model="astrai", messages=MSGS, max_tokens=8, temperature=0)
    biased = {str(a_id): 3.0}
    plain = oai.chat.completions.create(**base, logit_bias=biased).choices[0].message.content
    pen = oai.chat.completions.create(**base, logit_bias=biased, frequency_penalty=2.0)
    assert plain != pen.choices[0].message.content


def test_models_and_health(oai, base_url):
    import httpx

    assert [m.id for m in oai.models.list().data] == ["astrai"]
    oai.chat.completions.create(model="astrai", messages=MSGS, max_tokens=2)
    assert httpx.get(f"{base_url}/health").json() == {"status": "ok", "model_loaded": True}
    stats = httpx.get(f"{base_url}/stats").json()
    assert stats["requests_total"] > 0 and "kv_usage" in stats
    assert stats["ttft_p50"] > 0


def test_errors_are_typed(oai):
    with pytest.raises(openai.BadRequestError, match="temperature") as e:
        oai.chat.completions.create(model="astrai", messages=MSGS, temperature=5)
    assert e.value.status_code == 400
    assert e.value.body["type"] == "invalid_request_error"
    assert e.value.body["param"] == "temperature"
    with pytest.raises(openai.BadRequestError, match="prompt is too long"):
        oai.chat.completions.create(
            model="astrai", messages=[{"role": "user", "content": "word " * 2000}]
        )
