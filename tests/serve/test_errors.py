"""Bad requests get a 4xx with the protocol's error body (never a 500); auth; 503."""

import anthropic
import httpx
import openai
import pytest

from astrai.serve import ServerThread, ServeSettings, create_app

CHAT = "/v1/chat/completions"
MSG = "/v1/messages"
OK_CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
OK_MSG = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


def _openai_shape(r: httpx.Response, status: int = 400) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    return err


def _anthropic_shape(r: httpx.Response, status: int = 400) -> dict:
    assert r.status_code == status, r.text
    body = r.json()
    assert body["type"] == "error" and set(body["error"]) == {"type", "message"}
    return body["error"]


BAD_CHAT = [
    ({**OK_CHAT, "temperature": "hot"}, "temperature"),
    ({**OK_CHAT, "temperature": 2.5}, "temperature"),
    ({**OK_CHAT, "top_p": 1.5}, "top_p"),
    ({**OK_CHAT, "n": 0}, "n"),
    ({**OK_CHAT, "max_tokens": 0}, "max_tokens"),
    ({**OK_CHAT, "presence_penalty": 3}, "presence_penalty"),
    ({**OK_CHAT, "logit_bias": {"5": 500}}, "logit_bias"),
    ({**OK_CHAT, "logit_bias": {"999999": 1}}, "logit_bias"),
    ({**OK_CHAT, "stop": 5}, "stop"),
    ({**OK_CHAT, "messages": []}, "messages"),
    ({**OK_CHAT, "messages": [{"role": "wizard", "content": "x"}]}, "messages.0.role"),
    ({**OK_CHAT, "messages": [{"role": "user", "content": 5}]}, "messages.0.content"),
    ({**OK_CHAT, "messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages"),
    ({**OK_CHAT, "messages": "hi"}, "messages"),
    ({"max_tokens": 2}, "messages"),
    ({**OK_CHAT, "tools": [{"type": "function", "function": {"name": ""}}]}, "tools"),
    (
        {**OK_CHAT, "tools": [], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
        None,
    ),
    ({**OK_CHAT, "messages": [{"role": "user", "content": "word " * 3000}]}, "messages"),
]


@pytest.mark.parametrize("body, field", BAD_CHAT)
def test_openai_bad_requests(base_url, body, field):
    err = _openai_shape(httpx.post(base_url + CHAT, json=body, timeout=30))
    assert err["type"] == "invalid_request_error"
    if field is not None:
        assert err["param"].startswith(field), err
        assert field.split(".")[0] in err["message"]


BAD_MSG = [
    ({**OK_MSG, "max_tokens": -1}, "max_tokens"),
    ({**OK_MSG, "temperature": "x"}, "temperature"),
    ({**OK_MSG, "top_k": -5}, "top_k"),
    ({**OK_MSG, "messages": []}, "messages"),
    ({**OK_MSG, "messages": [{"role": "tool", "content": "x"}]}, "role"),
    ({**OK_MSG, "messages": [{"role": "user", "content": [{"type": "image"}]}]}, "messages"),
    ({**OK_MSG, "stop_sequences": "STOP"}, "stop_sequences"),
    ({**OK_MSG, "system": 5}, "system"),
    ({**OK_MSG, "messages": [{"role": "user", "content": "word " * 3000}]}, "too long"),
]


@pytest.mark.parametrize("body, field", BAD_MSG)
def test_anthropic_bad_requests(base_url, body, field):
    err = _anthropic_shape(httpx.post(base_url + MSG, json=body, timeout=30))
    assert err["type"] == "invalid_request_error"
    assert field in err["message"]


@pytest.mark.parametrize("path, shape", [(CHAT, _openai_shape), (MSG, _anthropic_shape)])
def test_malformed_json_and_unknown_routes(base_url, path, shape):
    r = httpx.post(
        base_url + path, content=b'{"messages": [', headers={"content-type": "application/json"}
    )
    assert "JSON" in shape(r)["message"]
    shape(httpx.post(base_url + path, content=b"\xff\xfe garbage"))
    shape(httpx.get(base_url + path), 405)
    _openai_shape(httpx.get(base_url + "/v1/nothing"), 404)


def test_server_keeps_serving(base_url, oai):
    for body, _ in BAD_CHAT[:5]:
        httpx.post(base_url + CHAT, json=body)
    assert httpx.get(base_url + "/health").status_code == 200
    r = oai.chat.completions.create(model="astrai", messages=OK_CHAT["messages"], max_tokens=2)
    assert r.choices[0].finish_reason in ("stop", "length")


def test_api_key(engine):
    with ServerThread(create_app(engine, ServeSettings(api_key="sekret"))) as srv:
        r = httpx.post(srv.url + CHAT, json=OK_CHAT)
        assert _openai_shape(r, 401)["type"] == "authentication_error"
        _anthropic_shape(httpx.post(srv.url + MSG, json=OK_MSG), 401)
        ok = httpx.post(srv.url + CHAT, json=OK_CHAT, headers={"authorization": "Bearer sekret"})
        assert ok.status_code == 200
        ok = httpx.post(srv.url + MSG, json=OK_MSG, headers={"x-api-key": "sekret"})
        assert ok.status_code == 200
        assert httpx.get(srv.url + "/health").status_code == 200  # probes need no key
        with (
            openai.OpenAI(base_url=srv.url + "/v1", api_key="wrong", max_retries=0) as c,
            pytest.raises(openai.AuthenticationError, match="API key"),
        ):
            c.chat.completions.create(model="astrai", messages=OK_CHAT["messages"])
        with anthropic.Anthropic(base_url=srv.url, api_key="sekret", max_retries=0) as c:
            assert c.messages.create(model="astrai", max_tokens=2, messages=OK_MSG["messages"])


def test_503_when_not_ready_or_queue_full(engine, base_url, model_dir):
    from astrai.inference import InferenceEngine

    cold = InferenceEngine(engine.model, engine.tokenizer, max_batch_size=2, start=False)
    with ServerThread(create_app(cold)) as srv:
        r = httpx.post(srv.url + CHAT, json=OK_CHAT)
        assert _openai_shape(r, 503)["message"] == "engine not ready"
        assert r.headers["retry-after"] == "1"
        assert httpx.get(srv.url + "/health").status_code == 503
        _anthropic_shape(httpx.post(srv.url + MSG, json=OK_MSG), 503)
    cold.shutdown()

    engine.scheduler.max_queue = 0  # "full" for the next request
    try:
        r = httpx.post(base_url + MSG, json=OK_MSG)
        assert "queue is full" in _anthropic_shape(r, 503)["message"]
        assert r.headers["retry-after"] == "1"
        with (
            openai.OpenAI(base_url=base_url + "/v1", api_key="x", max_retries=0) as c,
            pytest.raises(openai.InternalServerError, match="queue is full"),
        ):
            c.chat.completions.create(model="astrai", messages=OK_CHAT["messages"])
    finally:
        engine.scheduler.max_queue = None


def test_a_request_is_checked_once(base_url, monkeypatch):
    """The engine's one request check runs once per HTTP request, and its refusal of a bad
    setting is the 400 that names the parameter."""
    from astrai.inference import InferenceEngine, SamplingParams

    validations, checks = [], []
    validate, check = SamplingParams.validate, InferenceEngine.check_request

    def counting_validate(self, *args, **kwargs):
        validations.append(self)
        return validate(self, *args, **kwargs)

    def counting_check(self, prompt_ids, params):
        checks.append(params)
        return check(self, prompt_ids, params)

    monkeypatch.setattr(SamplingParams, "validate", counting_validate)
    monkeypatch.setattr(InferenceEngine, "check_request", counting_check)
    r = httpx.post(base_url + CHAT, json=OK_CHAT, timeout=30)
    assert r.status_code == 200, r.text
    assert len(checks) == 1 and len(validations) == 1
    bad = {**OK_CHAT, "logit_bias": {"999999": 1}}  # the schema cannot know the vocabulary
    err = _openai_shape(httpx.post(base_url + CHAT, json=bad, timeout=30))
    assert err["param"] == "logit_bias" and len(checks) == 2 and len(validations) == 2
