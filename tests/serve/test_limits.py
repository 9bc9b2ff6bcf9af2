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


# --------------------------------------------------------------------------- JSON depth
USER = [{"role": "user", "content": "hi"}]


def _nest(levels: int) -> object:
    value: object = 1
    for _ in range(levels):
        value = [value]
    return value


def _depth(value: object) -> int:
    """Levels of arrays and objects in `value` (a scalar: 0), counted independently."""
    best, todo = 0, [(value, 1)]
    while todo:
        item, level = todo.pop()
        if isinstance(item, dict | list):
            best = max(best, level)
            todo += [(v, level + 1) for v in (item.values() if isinstance(item, dict) else item)]
    return best


# (route, field, body with the nested value at the slot). Every route that takes a body.
DEEP = [
    (
        CHAT,
        "tools",
        lambda v: {
            "messages": USER,
            "tools": [{"type": "function", "function": {"name": "f", "parameters": {"x": v}}}],
        },
    ),
    (CHAT, "chat_template_kwargs", lambda v: {"messages": USER, "chat_template_kwargs": {"x": v}}),
    (COMPL, "user_data", lambda v: {"prompt": "hi", "user_data": {"x": v}}),
    (
        MSG,
        "messages",
        lambda v: {
            "messages": [
                *USER,
                {
                    "role": "assistant",
                    "content": [{"type": "tool_use", "id": "t1", "name": "f", "input": {"x": v}}],
                },
                {
                    "role": "user",
                    "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "ok"}],
                },
            ]
        },
    ),
    (
        MSG,
        "tools",
        lambda v: {"messages": USER, "tools": [{"name": "f", "input_schema": {"x": v}}]},
    ),
    (
        "/v1/messages/count_tokens",
        "tools",
        lambda v: {"messages": USER, "tools": [{"name": "f", "input_schema": {"x": v}}]},
    ),
    ("/v1/score", "text_2", lambda v: {"text_1": "hi", "text_2": [v]}),
]


@pytest.mark.parametrize(("path", "field", "make"), DEEP, ids=[f"{p}-{f}" for p, f, _ in DEEP])
def test_json_nested_past_the_limit_is_a_400_on_every_route(
    base_url, tokenize_calls, path, field, make
):
    """Nesting of 600-990 levels was a RecursionError 500; now anything past
    `MAX_JSON_DEPTH` is refused naming the field, before any work, and the limit itself
    is served (or refused for another reason), never a 500."""
    from astrai.serve.limits import MAX_JSON_DEPTH

    around = _depth(make([[]])) - 2  # containers around the slot: [[]] adds two levels

    def body(total: int) -> bytes:  # as text: the client's json.dumps recurses too
        levels = total - around
        text = json.dumps({"model": "astrai", "max_tokens": 2, **make("SLOT")})
        return text.replace('"SLOT"', "[" * levels + "1" + "]" * levels).encode()

    assert _depth(json.loads(body(MAX_JSON_DEPTH + 1))) == MAX_JSON_DEPTH + 1
    for total in (MAX_JSON_DEPTH + 1, 600, 990):
        r = httpx.post(base_url + path, content=body(total), timeout=60)
        err = _assert_shape(path, r, 400)
        assert err["message"].startswith(f"{field}: nested deeper than the limit of 100"), err
        if not path.startswith(MSG):
            assert err["param"] == field and err["code"] == "json_too_deep"
    assert tokenize_calls == []
    assert _depth(json.loads(body(MAX_JSON_DEPTH))) == MAX_JSON_DEPTH
    r = httpx.post(base_url + path, content=body(MAX_JSON_DEPTH), timeout=60)
    assert r.status_code in (200, 400), r.text[:300]
    assert "nested deeper" not in r.text
    assert httpx.get(base_url + "/health").status_code == 200


def test_string_content_and_escapes_do_not_count_as_nesting(base_url):
    """Brackets inside strings (escaped quotes too) are text, not nesting."""
    text = '[[{{"\\"' * 40 + "]}"  # 160 brackets, and quotes a naive scan would end on
    r = httpx.post(base_url + COMPL, json={"prompt": text, "max_tokens": 1}, timeout=60)
    assert r.status_code == 200, r.text[:300]


def test_string_checks_walk_any_depth_without_recursion():
    """The surrogate and character checks walk a value iteratively: no RecursionError at
    any depth (bodies are held to MAX_JSON_DEPTH; Python callers are not)."""
    from astrai.serve.errors import APIError
    from astrai.serve.limits import check_prompt_chars, check_unicode

    deep: object = "a\ud800b"
    for _ in range(5000):
        deep = [deep]
    with pytest.raises(APIError) as err:
        check_unicode({"messages": deep})
    assert err.value.param == "messages" + ".0" * 5000
    with pytest.raises(APIError, match="messages: the prompt is too long: 3 characters"):
        check_prompt_chars({"messages": deep}, ("messages",), 2)
