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
    # Usage once, on the final chunk (empty choices); every other chunk's usage is null.
    assert all(c.usage is None for c in chunks[:-1])
    last = chunks[-1]
    assert last.choices == [] and last.usage.completion_tokens == len(tokenizer.encode(TEXT)) + 1


def _usage_fields(base_url: str, path: str, body: dict) -> list[tuple[bool, object]]:
    """(has a `usage` key, its value) of every chunk of a raw SSE stream."""
    import json

    import httpx

    out = []
    with httpx.stream("POST", f"{base_url}{path}", json=body, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                chunk = json.loads(line[6:])
                out.append(("usage" in chunk, chunk.get("usage")))
    return out


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_streamed_usage_is_sent_once_as_openai_documents(base_url, script, path):
    """OpenAI: with `include_usage` every chunk has `usage`, null except the final one;
    without it no chunk has the field. Chat and legacy completions alike."""
    script(TEXT)
    body = {"model": "astrai", "max_tokens": 64, "stream": True, "n": 2}
    body |= {"messages": MSGS} if path.endswith("chat/completions") else {"prompt": "Hello"}
    with_usage = _usage_fields(base_url, path, {**body, "stream_options": {"include_usage": True}})
    assert len(with_usage) > 3 and all(has for has, _ in with_usage)
    assert [u for _, u in with_usage[:-1]] == [None] * (len(with_usage) - 1)
    final = with_usage[-1][1]
    assert final["total_tokens"] == final["prompt_tokens"] + final["completion_tokens"] > 0
    without = _usage_fields(base_url, path, body)
    assert len(without) > 3 and not any(has for has, _ in without)


def test_langchain_streamed_usage_equals_the_plain_usage(base_url, script, tokenizer):
    """LangChain's `ChatOpenAI` adds up the usage of every chunk it streams: a usage sent
    on the finish chunk too was counted twice (44/12 for 22/6)."""
    from langchain_openai import ChatOpenAI

    script(TEXT)
    llm = ChatOpenAI(
        base_url=f"{base_url}/v1", api_key="x", model="astrai", max_tokens=64, stream_usage=True
    )
    plain = llm.invoke("Say hello").usage_metadata
    total = None
    for chunk in llm.stream("Say hello"):
        total = chunk if total is None else total + chunk
    assert total.content == TEXT
    assert plain["input_tokens"] > 0
    assert plain["output_tokens"] == len(tokenizer.encode(TEXT)) + 1  # the text and the end
    assert total.usage_metadata == plain


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
