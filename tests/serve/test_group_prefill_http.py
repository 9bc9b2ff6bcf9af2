"""HTTP `n` runs each prompt's choices as one engine group: with a paged engine's prefix
cache the prompt is prefilled once (the other choices find its pages: `/stats`
`cached_prompt_tokens`), and choice `i` still draws with `seed + i`, as one request with
that seed does. Through the real `openai` SDK."""

from __future__ import annotations

import httpx
import openai
import pytest

from astrai.inference import InferenceEngine
from astrai.inference.params import MAX_N
from astrai.model import AutoModel
from astrai.serve import ServerThread, ServeSettings, create_app
from astrai.serve.schemas import MAX_N as SERVE_MAX_N

PAGE = 16
QUESTION = (
    "Please explain, step by step and with an example, how a radix tree shares the pages "
    "of a common prompt prefix between several requests."
)


@pytest.fixture(scope="module")
def paged_url(model_dir, tokenizer):
    model = AutoModel.from_pretrained(model_dir).eval()
    engine = InferenceEngine(
        model, tokenizer, max_batch_size=8, max_seq_len=512, cache_mode="paged", page_size=PAGE
    )
    with ServerThread(create_app(engine, ServeSettings())) as srv:
        yield srv.url
    engine.shutdown()


def _client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=60)


def _stats(url: str) -> dict:
    return httpx.get(url + "/stats", timeout=30).json()


def test_chat_n_prefills_the_prompt_once_with_the_seeds_of_single_requests(paged_url):
    before = _stats(paged_url)
    kw = dict(model="astrai", max_tokens=6, temperature=1.0, seed=21)
    messages = [{"role": "user", "content": QUESTION}]
    with _client(paged_url) as oai:
        r = oai.chat.completions.create(messages=messages, n=4, **kw)
        after = _stats(paged_url)
        singles = [
            oai.chat.completions.create(messages=messages, **{**kw, "seed": 21 + i})
            for i in range(4)
        ]
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    prompt = r.usage.prompt_tokens
    assert prompt > PAGE  # a full page before the last token: the followers are held
    assert after["total_prompt_tokens"] - before["total_prompt_tokens"] == 4 * prompt
    cached = after["cached_prompt_tokens"] - before["cached_prompt_tokens"]
    assert cached >= 3 * ((prompt - 1) // PAGE * PAGE)
    texts = [c.message.content for c in r.choices]
    assert texts == [s.choices[0].message.content for s in singles]


def test_completions_batch_n_choice_i_draws_with_seed_plus_i(paged_url):
    prompts = ["def fibonacci(n):\n    " * 4, "import collections\n" * 3]
    kw = dict(model="astrai", max_tokens=5, temperature=1.0)
    with _client(paged_url) as oai:
        r = oai.completions.create(prompt=prompts, n=2, seed=3, **kw)
        texts = [c.text for c in sorted(r.choices, key=lambda c: c.index)]
        singles = [
            oai.completions.create(prompt=prompts[i // 2], seed=3 + i, **kw).choices[0].text
            for i in range(4)
        ]
    assert texts == singles


def test_the_server_and_the_engine_share_one_n_limit():
    assert SERVE_MAX_N is MAX_N
