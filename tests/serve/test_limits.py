"""Input limits: the body limit (413), the prompt character limit and lone surrogates (400),
all refused before tokenizing, while /health and other streams keep going."""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest

from astrai.serve import ServerThread, ServeSettings, create_app
from astrai.tokenizer import AutoTokenizer

CHAT = "/v1/chat/completions"
COMPL = "/v1/completions"
MSG = "/v1/messages"
MB = 1024 * 1024


def _body(path: str, text: str) -> bytes:
    """A request for `path` whose prompt is `text` (raw JSON, so any size or escape)."""
    if path == COMPL:
        return b'{"prompt":"' + text.encode() + b'","max_tokens":2}'
    return b'{"messages":[{"role":"user","content":"' + text.encode() + b'"}],"max_tokens":2}'


def _assert_shape(path: str, r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text[:300]
    body = r.json()
    if path.startswith(MSG):
        assert body["type"] == "error" and set(body["error"]) == {"type", "message"}
        return body["error"]
    assert set(body["error"]) == {"message", "type", "param", "code"}
    return body["error"]


@pytest.fixture
def tokenize_calls(monkeypatch) -> list[str]:
    """Names of the tokenizer's encoding methods called while the test runs."""
    calls: list[str] = []
    for name in ("encode", "batch_encode", "apply_chat_template", "encode_with_offsets"):
        original = getattr(AutoTokenizer, name)

        def wrapped(self, *args, _name=name, _original=original, **kwargs):
            calls.append(_name)
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(AutoTokenizer, name, wrapped)
    return calls


class _Prober(threading.Thread):
    """Polls /health until stopped; records (status, seconds) of each probe."""

    def __init__(self, url: str) -> None:
        super().__init__(daemon=True)
        self.url, self.stop, self.probes = url, threading.Event(), []

    def run(self) -> None:
        with httpx.Client(timeout=30) as client:
            while not self.stop.is_set():
                t0 = time.perf_counter()
                status = client.get(self.url + "/health").status_code
                self.probes.append((status, time.perf_counter() - t0))
                time.sleep(0.02)


class _Streamer(threading.Thread):
    """One streamed chat request with a scripted answer; records the text and the end."""

    def __init__(self, url: str) -> None:
        super().__init__(daemon=True)
        self.url, self.text, self.done = url, "", False

    def run(self) -> None:
        body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 200, "stream": True}
        with httpx.stream("POST", self.url + CHAT, json=body, timeout=120) as r:
            for line in r.iter_lines():
                if line == "data: [DONE]":
                    self.done = True
                elif line.startswith("data: "):
                    delta = json.loads(line[6:])["choices"][0]["delta"]
                    self.text += delta.get("content") or ""


@pytest.mark.parametrize("path", [CHAT, COMPL, MSG])
def test_10mb_body_is_413_while_health_and_streams_go_on(base_url, script, path, tokenize_calls):
    script("lorem ipsum dolor sit amet " * 6)
    expected = "lorem ipsum dolor sit amet " * 6
    prober, streamer = _Prober(base_url), _Streamer(base_url)
    prober.start()
    streamer.start()
    try:
        while not prober.probes:
            time.sleep(0.01)
        before = len(tokenize_calls)
        r = httpx.post(
            base_url + path,
            content=_body(path, "a" * (10 * MB)),
            headers={"content-type": "application/json"},
            timeout=120,
        )
        err = _assert_shape(path, r, 413)
        assert "too large" in err["message"]
        assert tokenize_calls[before:].count("apply_chat_template") <= 1  # the stream's only
        time.sleep(0.2)
    finally:
        prober.stop.set()
        prober.join(30)
        streamer.join(120)
    assert prober.probes and all(s == 200 for s, _ in prober.probes), prober.probes
    assert max(t for _, t in prober.probes) < 1.0, prober.probes
    assert streamer.done and streamer.text == expected


@pytest.mark.parametrize("path", [CHAT, COMPL, MSG])
def test_50mb_body_never_reaches_the_tokenizer(base_url, path, tokenize_calls):
    r = httpx.post(
        base_url + path,
        content=_body(path, "<|im_start|>x" * (4 * MB)),
        headers={"content-type": "application/json"},
        timeout=120,
    )
    _assert_shape(path, r, 413)
    assert tokenize_calls == []


def test_chunked_body_over_the_limit_is_413(base_url, tokenize_calls):
    """No Content-Length: the limit is enforced by counting the chunks as they arrive."""

    def chunks():
        yield b'{"messages":[{"role":"user","content":"'
        for _ in range(80):
            yield b"b" * 65536
        yield b'"}],"max_tokens":2}'

    r = httpx.post(
        base_url + CHAT, content=chunks(), headers={"content-type": "application/json"}, timeout=60
    )
    assert "content-length" not in r.request.headers
    _assert_shape(CHAT, r, 413)
    assert tokenize_calls == []
    assert httpx.get(base_url + "/health").status_code == 200


def test_body_under_the_limit_is_served(engine):
    settings = ServeSettings(max_body_bytes=4096, max_prompt_chars=None)
    with ServerThread(create_app(engine, settings)) as srv:
        json_ct = {"content-type": "application/json"}
        ok = httpx.post(srv.url + CHAT, content=_body(CHAT, "x" * 100), headers=json_ct)
        assert ok.status_code == 200, ok.text
        big = httpx.post(srv.url + CHAT, content=_body(CHAT, "x" * 5000), headers=json_ct)
        _assert_shape(CHAT, big, 413)


@pytest.fixture(scope="module")
def small_prompts(engine):
    with ServerThread(create_app(engine, ServeSettings(max_prompt_chars=1000))) as srv:
        yield srv.url


@pytest.mark.parametrize(
    "path, body, field",
    [
        (CHAT, {"messages": [{"role": "user", "content": "x" * 1001}]}, "messages"),
        (
            CHAT,
            {"messages": [{"role": "user", "content": [{"type": "text", "text": "y" * 600}]}] * 2},
            "messages",
        ),
        (COMPL, {"prompt": "x" * 1001}, "prompt"),
        (COMPL, {"prompt": ["x" * 600, "y" * 600]}, "prompt"),
        (MSG, {"messages": [{"role": "user", "content": "x" * 1001}]}, "messages"),
        (MSG, {"system": "s" * 1500, "messages": [{"role": "user", "content": "x"}]}, "system"),
    ],
)
def test_prompt_over_the_character_limit(small_prompts, tokenize_calls, path, body, field):
    r = httpx.post(small_prompts + path, json={**body, "max_tokens": 2}, timeout=60)
    err = _assert_shape(path, r, 400)
    assert err["message"].startswith(field) and "characters" in err["message"], err
    if not path.startswith(MSG):
        assert err["param"] == field
    assert tokenize_calls == []


def test_prompt_at_the_character_limit_is_served(small_prompts):
    r = httpx.post(small_prompts + COMPL, json={"prompt": "x" * 1000, "max_tokens": 1}, timeout=60)
    assert r.status_code == 200, r.text


def _raw(path: str, model: str = '"astrai"', content: str = '"hi"', stream: bool = False) -> bytes:
    key = "prompt" if path == COMPL else "messages"
    prompt = content if path == COMPL else f'[{{"role":"user","content":{content}}}]'
    s = "true" if stream else "false"
    return f'{{"model":{model},"{key}":{prompt},"max_tokens":2,"stream":{s}}}'.encode()


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("path", [CHAT, COMPL, MSG])
def test_lone_surrogate_is_a_400(base_url, path, stream):
    headers = {"content-type": "application/json"}
    r = httpx.post(
        base_url + path, content=_raw(path, model='"\\udfff"', stream=stream), headers=headers
    )
    err = _assert_shape(path, r, 400)
    assert err["message"].startswith("model")
    r = httpx.post(
        base_url + path, content=_raw(path, content='"a\\ud800b"', stream=stream), headers=headers
    )
    err = _assert_shape(path, r, 400)
    field = "prompt" if path == COMPL else "messages.0.content"
    assert err["message"].startswith(field), err
    # a surrogate pair is a real character: served
    r = httpx.post(
        base_url + path,
        content=_raw(path, content='"\\ud83d\\ude00"', stream=stream),
        headers=headers,
    )
    assert r.status_code == 200, r.text
    if stream:
        assert r.text.rstrip().endswith("[DONE]") or "message_stop" in r.text


def test_surrogate_in_a_dict_key_or_tool(base_url):
    body = (
        b'{"messages":[{"role":"user","content":"hi"}],"max_tokens":2,"tools":[{"type":"function",'
        b'"function":{"name":"f","parameters":{"type":"object","\\udc80":1}}}]}'
    )
    r = httpx.post(base_url + CHAT, content=body, headers={"content-type": "application/json"})
    err = _assert_shape(CHAT, r, 400)
    assert err["param"].startswith("tools.0.function.parameters"), err
    assert httpx.get(base_url + "/health").status_code == 200


def test_prompts_are_tokenized_off_the_event_loop(base_url, monkeypatch, oai, ant):
    """Rendering and tokenizing run on the tokenizer pool, never on the event loop thread."""
    threads: list[str] = []
    for name in ("encode", "apply_chat_template"):
        original = getattr(AutoTokenizer, name)

        def wrapped(self, *args, _original=original, **kwargs):
            threads.append(threading.current_thread().name)
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(AutoTokenizer, name, wrapped)
    oai.chat.completions.create(
        model="astrai", messages=[{"role": "user", "content": "hi"}], max_tokens=1
    )
    oai.completions.create(model="astrai", prompt="hi", max_tokens=1)
    ant.messages.create(model="astrai", messages=[{"role": "user", "content": "hi"}], max_tokens=1)
    ant.messages.count_tokens(model="astrai", messages=[{"role": "user", "content": "hi"}])
    assert len(threads) >= 4
    assert all(t.startswith("astrai-tokenize") for t in threads), threads
