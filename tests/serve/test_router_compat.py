"""The worker routes the existing routers ask for (astrai.serve.router_compat): vLLM's
`POST /tokenize` answers the ids the request would be submitted with (checked against the
tokenizer itself: `encode`, the chat template), SGLang's `/get_server_info` and
`/get_model_info` the served name."""

import httpx
import pytest

from astrai.serve import ServerThread, ServeSettings, create_app


def test_tokenize_prompt_is_the_tokenizer_encoding(base_url, tokenizer):
    prompt = "def tokenize(text):\n    return text.split()"
    # vLLM's default `add_special_tokens: true` runs the post-processor (a BOS here); false
    # gives the ids `/v1/completions` submits (a prompt as given).
    r = httpx.post(f"{base_url}/tokenize", json={"model": "x", "prompt": prompt})
    assert r.status_code == 200, r.text
    assert r.json()["tokens"] == tokenizer.encode(prompt, add_special_tokens=True)
    r = httpx.post(f"{base_url}/tokenize", json={"prompt": prompt, "add_special_tokens": False})
    body = r.json()
    assert body["tokens"] == tokenizer.encode(prompt)
    assert body["count"] == len(body["tokens"]) and body["token_strs"] is None
    assert body["max_model_len"] == 1024  # the engine's context (serve conftest's engine)


def test_tokenize_messages_is_the_chat_template_with_generation_prompt(base_url, tokenizer):
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is a prefix?"},
    ]
    r = httpx.post(f"{base_url}/tokenize", json={"messages": messages, "return_token_strs": True})
    assert r.status_code == 200, r.text
    want = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    assert r.json()["tokens"] == list(want)
    assert r.json()["token_strs"] == [tokenizer.decode([t]) for t in want]
    # the same count a chat request reports as its prompt
    chat = httpx.post(
        f"{base_url}/v1/chat/completions", json={"messages": messages, "max_tokens": 1}
    ).json()
    assert chat["usage"]["prompt_tokens"] == len(want)


@pytest.mark.parametrize(
    ("body", "field"),
    [({"model": "x"}, "prompt"), ({"prompt": 3}, "prompt"), ({"messages": "hi"}, "messages")],
)
def test_tokenize_refuses_a_bad_body_naming_the_field(base_url, body, field):
    r = httpx.post(f"{base_url}/tokenize", json=body)
    assert r.status_code == 400
    assert r.json()["error"]["message"].startswith(field)


def test_model_and_server_info_name_the_served_model(base_url):
    for path in ("/get_model_info", "/model_info"):
        body = httpx.get(base_url + path).json()
        assert body == {"model_path": "astrai", "tokenizer_path": "astrai", "is_generation": True}
    for path in ("/get_server_info", "/server_info"):
        body = httpx.get(base_url + path).json()
        assert body["served_model_name"] == body["model_path"] == "astrai"
        assert body["context_length"] == 1024


def test_tokenize_needs_the_api_key(engine):
    app = create_app(engine, ServeSettings(api_key="secret"))
    with ServerThread(app) as srv:
        r = httpx.post(f"{srv.url}/tokenize", json={"prompt": "a"})
        assert r.status_code == 401
        ok = httpx.post(
            f"{srv.url}/tokenize", json={"prompt": "a"}, headers={"authorization": "Bearer secret"}
        )
        assert ok.status_code == 200
