"""API completeness: models.retrieve, messages.count_tokens, Allow on 405, the OpenAPI
document's error statuses, the per-request timeout, and graceful shutdown of streams."""

from __future__ import annotations

import json
import threading
import time

import anthropic
import httpx
import openai
import pytest

from astrai.serve import ServerThread, ServeSettings, create_app

POSTS = ["/v1/chat/completions", "/v1/completions", "/v1/messages", "/v1/messages/count_tokens"]


def test_models_retrieve(oai, base_url):
    listed = [m.id for m in oai.models.list()]
    assert listed == ["astrai"]
    model = oai.models.retrieve("astrai")
    assert model.id == "astrai" and model.object == "model"
    with pytest.raises(openai.NotFoundError) as info:
        oai.models.retrieve("no-such-model")
    err = info.value.body
    assert err["type"] == "not_found_error" and err["code"] == "model_not_found", err
    r = httpx.get(base_url + "/v1/models/org/no-such-model")
    assert r.status_code == 404 and set(r.json()["error"]) == {"message", "type", "param", "code"}


TOOLS = [
    {
        "name": "get_weather",
        "description": "Weather of a city",
        "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}},
    }
]


@pytest.mark.parametrize(
    "extra",
    [
        {},
        {"system": "You are terse."},
        {"system": [{"type": "text", "text": "Be kind."}], "tools": TOOLS},
        {"tools": TOOLS, "tool_choice": {"type": "tool", "name": "get_weather"}},
    ],
)
def test_count_tokens_equals_input_tokens(ant, extra):
    messages = [
        {"role": "user", "content": "What is the weather in Paris?"},
        {"role": "assistant", "content": "Let me check."},
        {"role": "user", "content": [{"type": "text", "text": "Quickly, please."}]},
    ]
    counted = ant.messages.count_tokens(model="astrai", messages=messages, **extra)
    sent = ant.messages.create(model="astrai", max_tokens=2, messages=messages, **extra)
    assert counted.input_tokens == sent.usage.input_tokens > 0


def test_count_tokens_errors(ant, base_url):
    with pytest.raises(anthropic.BadRequestError):
        ant.messages.count_tokens(model="astrai", messages=[])
    r = httpx.post(base_url + "/v1/messages/count_tokens", json={"messages": "x"})
    assert r.status_code == 400 and r.json()["type"] == "error"


@pytest.mark.parametrize("path", POSTS)
def test_405_carries_allow(base_url, path):
    r = httpx.get(base_url + path)
    assert r.status_code == 405
    assert r.headers["allow"] == "POST"
    body = r.json()
    assert ("type" in body and body["type"] == "error") or "error" in body
    r = httpx.post(base_url + "/v1/models")
    assert r.status_code == 405 and r.headers["allow"].split(", ") == ["GET"]


def test_openapi_lists_the_statuses_returned(base_url):
    doc = httpx.get(base_url + "/openapi.json").json()
    for path in POSTS:
        responses = doc["paths"][path]["post"]["responses"]
        assert "422" not in responses, path
        for status in ("200", "400", "401", "413", "500", "503"):
            assert status in responses, (path, status)
        shape = "AnthropicError" if path.startswith("/v1/messages") else "OpenAIError"
        schema = responses["400"]["content"]["application/json"]["schema"]
        assert schema["$ref"].endswith(shape)
    assert "504" in doc["paths"]["/v1/chat/completions"]["post"]["responses"]
    retrieve = doc["paths"]["/v1/models/{model_id}"]["get"]["responses"]
    assert "404" in retrieve and "422" not in retrieve
    assert "HTTPValidationError" not in doc["components"]["schemas"]
    # and the server does answer 400 where FastAPI would have said 422
    r = httpx.post(base_url + "/v1/chat/completions", json={"messages": 5})
    assert r.status_code == 400


@pytest.mark.slow
@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/messages", "/v1/completions"])
def test_non_streamed_request_times_out(engine, script, monkeypatch, path):
    script("tick tock " * 300)
    cancelled = []
    original = engine.cancel

    def cancel(result):
        cancelled.append(result)
        return original(result)

    monkeypatch.setattr(engine, "cancel", cancel)
    step = engine.step

    def slow_step(*args, **kwargs):  # 900 steps take >= 4.5 s: far past the timeout
        time.sleep(0.005)
        return step(*args, **kwargs)

    monkeypatch.setattr(engine, "step", slow_step)
    settings = ServeSettings(request_timeout_s=0.3)
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 900}
    if path == "/v1/completions":
        body = {"prompt": "hi", "max_tokens": 900}
    with ServerThread(create_app(engine, settings)) as srv:
        r = httpx.post(srv.url + path, json=body, timeout=120)
        assert r.status_code == 504, r.text
        assert r.json()["error"]["type"] == "timeout_error"
        assert (r.json().get("type") == "error") == (path == "/v1/messages")
        assert cancelled, "the engine task was not cancelled"
        deadline = time.monotonic() + 30
        while not all(c.done for c in cancelled) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert all(c.done for c in cancelled)
        assert all(len(c.task.output_ids) < 900 for c in cancelled)
        # streamed requests are not bound by it, and the server goes on
        with httpx.stream(
            "POST", srv.url + path, json={**body, "max_tokens": 20, "stream": True}, timeout=60
        ) as s:
            assert s.status_code == 200
            assert "[DONE]" in s.read().decode() or path == "/v1/messages"


@pytest.mark.slow
def test_graceful_shutdown_ends_open_streams(engine, script):
    script("slow and steady " * 300)
    srv = ServerThread(create_app(engine, ServeSettings()), timeout_graceful_shutdown=10)
    srv.start()
    lines: list[str] = []
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 900, "stream": True}
    with httpx.stream("POST", srv.url + "/v1/chat/completions", json=body, timeout=60) as r:
        it = r.iter_lines()
        while not any('"content"' in line for line in lines):
            lines.append(next(it))
        stopper = threading.Thread(target=srv.stop)
        stopper.start()
        lines += list(it)
    stopper.join(30)
    assert not srv.thread.is_alive()
    data = [line[6:] for line in lines if line.startswith("data: ")]
    assert data[-1] == "[DONE]"
    finals = [json.loads(d)["choices"][0]["finish_reason"] for d in data[:-1]]
    assert finals[-1] == "length"
