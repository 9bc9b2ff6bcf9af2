"""`priority` (vLLM's extra request field) on /v1/chat/completions, /v1/completions and
/v1/messages: carried to the engine's `SamplingParams.priority`; not an int, or non-zero on
an engine whose `scheduling_policy` is "fcfs", is a 400 naming `priority` (vLLM's rule)."""

from __future__ import annotations

import anthropic
import httpx
import openai
import pytest
from serve_helpers import served_engine_like

CHAT = dict(messages=[{"role": "user", "content": "hi"}], max_tokens=4, temperature=0)


@pytest.fixture(scope="module")
def prioritized(engine):
    """A server whose engine schedules by priority."""
    with served_engine_like(engine, scheduling_policy="priority") as (_, url):
        yield url


@pytest.mark.parametrize("value", [2, -1, "high", 1.5])
def test_fcfs_chat_refuses_a_priority_naming_it(oai, value):
    with pytest.raises(openai.BadRequestError) as info:
        oai.chat.completions.create(model="astrai", extra_body={"priority": value}, **CHAT)
    assert info.value.status_code == 400
    assert info.value.body["param"] == "priority", info.value.body


def test_fcfs_completions_refuses_a_priority_naming_it(oai):
    with pytest.raises(openai.BadRequestError) as info:
        oai.completions.create(
            model="astrai", prompt="hi", max_tokens=2, extra_body={"priority": 3}
        )
    assert info.value.body["param"] == "priority"
    assert "scheduling_policy=priority" in info.value.body["message"]


def test_fcfs_messages_refuses_a_priority(ant):
    with pytest.raises(anthropic.BadRequestError) as info:
        ant.messages.create(
            model="astrai",
            max_tokens=2,
            messages=[{"role": "user", "content": "hi"}],
            extra_body={"priority": 1},
        )
    assert info.value.status_code == 400
    assert info.value.body["error"]["message"].startswith("priority")


def test_fcfs_serves_the_default_priority(oai):
    out = oai.chat.completions.create(model="astrai", extra_body={"priority": 0}, **CHAT)
    assert out.choices[0].finish_reason in ("length", "stop")


def test_priority_server_serves_any_int_and_the_same_text(oai, prioritized):
    """Priority orders the queue; it never changes a request's (greedy) output."""
    reference = oai.chat.completions.create(model="astrai", **CHAT).choices[0].message.content
    with openai.OpenAI(base_url=f"{prioritized}/v1", api_key="x", max_retries=0) as client:
        for value in (-5, 0, 7):
            out = client.chat.completions.create(
                model="astrai", extra_body={"priority": value}, **CHAT
            )
            assert out.choices[0].message.content == reference
        with pytest.raises(openai.BadRequestError) as info:
            client.chat.completions.create(model="astrai", extra_body={"priority": "1.5"}, **CHAT)
        assert info.value.body["param"] == "priority"
    r = httpx.post(
        f"{prioritized}/v1/completions",
        json={"prompt": "hi", "max_tokens": 2, "priority": -2},
        timeout=30,
    )
    assert r.status_code == 200, r.text
