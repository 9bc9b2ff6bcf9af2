"""The official `anthropic` SDK against the server: create/stream, sync/async, helpers."""

import asyncio

import anthropic
import pytest

MSGS = [{"role": "user", "content": "Say hello"}]
TEXT = "Hello there, how are you today?"


def test_create_plain_with_system(ant, script, tokenizer):
    script(TEXT)
    m = ant.messages.create(model="astrai", system="Be brief.", messages=MSGS, max_tokens=64)
    assert m.type == "message" and m.role == "assistant" and m.id.startswith("msg_")
    assert [b.type for b in m.content] == ["text"]
    assert m.content[0].text == TEXT
    assert m.stop_reason == "end_turn" and m.stop_sequence is None
    prompt = tokenizer.apply_chat_template(
        [{"role": "system", "content": "Be brief."}, *MSGS],
        add_generation_prompt=True,
        tokenize=True,
    )
    assert m.usage.input_tokens == len(prompt)  # the system prompt was rendered
    assert m.usage.output_tokens == len(tokenizer.encode(TEXT)) + 1


def test_stream_events(ant, script):
    script(TEXT)
    events = list(ant.messages.create(model="astrai", messages=MSGS, max_tokens=64, stream=True))
    types = [e.type for e in events]
    assert types[0] == "message_start" and types[-2:] == ["message_delta", "message_stop"]
    assert types[1] == "content_block_start" and "content_block_stop" in types
    text = "".join(e.delta.text for e in events if e.type == "content_block_delta")
    assert text == TEXT
    assert events[-2].delta.stop_reason == "end_turn"
    assert events[-2].usage.output_tokens > 0


def test_stream_helper(ant, script):
    script(TEXT)
    with ant.messages.stream(model="astrai", messages=MSGS, max_tokens=64) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == TEXT == final.content[0].text
    assert final.stop_reason == "end_turn"
    assert final.usage.input_tokens > 0 and final.usage.output_tokens > 0


def test_async(aant, script):
    script(TEXT)

    async def go():
        m = await aant.messages.create(model="astrai", messages=MSGS, max_tokens=64)
        s = await aant.messages.create(model="astrai", messages=MSGS, max_tokens=64, stream=True)
        parts = [e.delta.text async for e in s if e.type == "content_block_delta"]
        async with aant.messages.stream(model="astrai", messages=MSGS, max_tokens=64) as st:
            streamed = "".join([t async for t in st.text_stream])
            final = await st.get_final_message()
        await aant.close()
        return m, "".join(parts), streamed, final

    m, parts, streamed, final = asyncio.run(go())
    assert m.content[0].text == parts == streamed == final.content[0].text == TEXT


@pytest.mark.parametrize("stream", [False, True])
def test_stop_sequences(ant, script, stream):
    script(TEXT)
    kwargs = dict(model="astrai", messages=MSGS, max_tokens=64, stop_sequences=["xyz", "are"])
    if stream:
        with ant.messages.stream(**kwargs) as s:
            m = s.get_final_message()
    else:
        m = ant.messages.create(**kwargs)
    assert m.content[0].text == "Hello there, how "
    assert m.stop_reason == "stop_sequence"
    assert m.stop_sequence == "are"


def test_max_tokens(ant, script):
    script(TEXT)
    m = ant.messages.create(model="astrai", messages=MSGS, max_tokens=2)
    assert m.stop_reason == "max_tokens" and m.usage.output_tokens == 2


def test_errors_are_typed(ant):
    with pytest.raises(anthropic.BadRequestError, match="max_tokens") as e:
        ant.messages.create(model="astrai", messages=MSGS, max_tokens=0)
    assert e.value.body == {
        "type": "error",
        "error": {"type": "invalid_request_error", "message": e.value.body["error"]["message"]},
    }
    with pytest.raises(anthropic.BadRequestError, match="role"):
        ant.messages.create(
            model="astrai", messages=[{"role": "system", "content": "x"}], max_tokens=5
        )
