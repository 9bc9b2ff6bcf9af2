"""Seeds the issue found crashing the loop: huge, at the generator's edge with n > 1, negative.

Every JSON integer maps into the generator's range (mod 2**64), so each request answers 200,
the same seed gives the same text, and the server keeps serving afterwards.
"""

from __future__ import annotations

import httpx
import pytest

CHAT = "/v1/chat/completions"
MESSAGES = [{"role": "user", "content": "hi"}]


def _chat(base_url: str, **extra) -> httpx.Response:
    body = {"messages": MESSAGES, "max_tokens": 4, "temperature": 1.0, **extra}
    return httpx.post(base_url + CHAT, json=body, timeout=60)


@pytest.mark.parametrize(
    "seed, n", [(1180591620717411303424, 1), (2**64 - 1, 2), (2**70, 1), (-3, 2)]
)
def test_any_integer_seed_answers_and_repeats(base_url, seed, n):
    first = _chat(base_url, seed=seed, n=n)
    assert first.status_code == 200, first.text
    texts = [c["message"]["content"] for c in first.json()["choices"]]
    assert len(texts) == n
    again = _chat(base_url, seed=seed, n=n)
    assert [c["message"]["content"] for c in again.json()["choices"]] == texts
    assert httpx.get(base_url + "/health").status_code == 200


def test_a_non_integer_seed_is_a_400_naming_it(base_url):
    r = _chat(base_url, seed="seven")
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "seed"
    assert _chat(base_url, seed=1).status_code == 200  # still serving
