"""vLLM's `POST /tokenize` and `POST /detokenize` (astrai.serve.tokenize_routes), checked
against the tokenizer itself: `encode` (with and without its post-processor), the chat
template (with and without the generation prompt), `decode`.

(`tests/serve/test_router_compat.py` checks the ids routers rely on.)
"""

from __future__ import annotations

import httpx
import pytest

PROMPT = "def f(x):\n    return x"
MESSAGES = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "What is a token?"},
]


def _post(url: str, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{url}{path}", json=body, timeout=30)


def test_prompt_add_special_tokens_defaults_to_true(base_url, tokenizer):
    # The suite's tokenizer's post-processor writes a BOS first (as a Llama tokenizer's does).
    with_special = tokenizer.encode(PROMPT, add_special_tokens=True)
    assert with_special[0] == tokenizer.bos_token_id
    assert with_special[1:] == tokenizer.encode(PROMPT)
    r = _post(base_url, "/tokenize", {"prompt": PROMPT})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["tokens"] == with_special and body["count"] == len(with_special)
    assert body["max_model_len"] == 1024  # the serve conftest engine's context
    off = _post(base_url, "/tokenize", {"prompt": PROMPT, "add_special_tokens": False}).json()
    assert off["tokens"] == tokenizer.encode(PROMPT)


def test_prompt_without_special_tokens_is_what_completions_submits(base_url):
    off = _post(base_url, "/tokenize", {"prompt": PROMPT, "add_special_tokens": False}).json()
    r = _post(base_url, "/v1/completions", {"prompt": PROMPT, "max_tokens": 1}).json()
    assert r["usage"]["prompt_tokens"] == off["count"]


@pytest.mark.parametrize("generation_prompt", [True, False])
def test_messages_are_the_chat_template(base_url, tokenizer, generation_prompt):
    want = tokenizer.apply_chat_template(
        MESSAGES, add_generation_prompt=generation_prompt, tokenize=True
    )
    body = {"messages": MESSAGES, "add_generation_prompt": generation_prompt}
    r = _post(base_url, "/tokenize", {**body, "return_token_strs": True})
    assert r.status_code == 200, r.text
    assert r.json()["tokens"] == list(want) and r.json()["count"] == len(want)
    assert r.json()["token_strs"] == [tokenizer.decode([t]) for t in want]
    # the prompt a chat request with the same option submits
    chat = _post(base_url, "/v1/chat/completions", {**body, "max_tokens": 1}).json()
    assert chat["usage"]["prompt_tokens"] == len(want)


def test_generation_prompt_changes_the_ids(base_url):
    on = _post(base_url, "/tokenize", {"messages": MESSAGES}).json()["tokens"]
    off = _post(base_url, "/tokenize", {"messages": MESSAGES, "add_generation_prompt": False})
    assert off.json()["tokens"] != on and on[: len(off.json()["tokens"])] == off.json()["tokens"]


def test_detokenize_is_the_tokenizer_decode(base_url, tokenizer):
    ids = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True)
    r = _post(base_url, "/detokenize", {"model": "astrai", "tokens": ids})
    assert r.status_code == 200, r.text
    assert r.json() == {"prompt": tokenizer.decode(ids)}
    assert "<|im_start|>" in r.json()["prompt"]  # special tokens are kept, as vLLM's
    assert _post(base_url, "/detokenize", {"tokens": []}).json() == {"prompt": ""}


def test_tokenize_detokenize_round_trip(base_url):
    body = {"prompt": PROMPT, "add_special_tokens": False}
    ids = _post(base_url, "/tokenize", body).json()["tokens"]
    assert _post(base_url, "/detokenize", {"tokens": ids}).json()["prompt"] == PROMPT


@pytest.mark.parametrize(
    ("path", "body", "field"),
    [
        ("/detokenize", {"tokens": [1, -1]}, "tokens"),
        ("/detokenize", {"tokens": [10**6]}, "tokens"),
        ("/detokenize", {"tokens": ["a"]}, "tokens.0"),
        ("/detokenize", {}, "tokens"),
        ("/tokenize", {"prompt": ["a", "b"]}, "prompt"),
        ("/tokenize", {"prompt": "a", "add_special_tokens": "yes"}, "add_special_tokens"),
        ("/tokenize", {"messages": MESSAGES, "add_special_tokens": True}, "add_special_tokens"),
        ("/tokenize", {"messages": MESSAGES, "add_generation_prompt": 3}, "add_generation_prompt"),
    ],
)
def test_bad_bodies_are_a_400_naming_the_field(base_url, tokenizer, path, body, field):
    r = _post(base_url, path, body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == field and err["message"].startswith(field)


def test_out_of_vocabulary_names_the_bound(base_url, tokenizer):
    r = _post(base_url, "/detokenize", {"tokens": [0, len(tokenizer)]})
    assert r.status_code == 400
    assert f"[1] = {len(tokenizer)}" in r.json()["error"]["message"]
    assert _post(base_url, "/detokenize", {"tokens": [len(tokenizer) - 1]}).status_code == 200
