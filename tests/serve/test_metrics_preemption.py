"""Preemption seen through HTTP: a paged pool that fits about three of the long requests
gets twelve at once over `/v1/completions`; all finish, greedy outputs equal a run with
ample memory, and `/metrics` counts the preemptions (the same figure as `get_stats()`).
(The engine-level cases, against plain-torch greedy decoding: tests/inference/
test_preemption.py.)"""

from __future__ import annotations

import asyncio
import random
import time

import httpx
from prometheus_client.parser import text_string_to_metric_families

from astrai.inference import InferenceEngine
from astrai.model import AutoModel
from astrai.serve import ServerThread, create_app

MAX_TOKENS = 40
# ~3 requests of up to 36 + 40 tokens (as in tests/inference/test_preemption.py).
SMALL = dict(cache_mode="paged", page_size=4, kv_tokens=240)
AMPLE = dict(cache_mode="paged", page_size=4, kv_tokens=4096)


def _prompts(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(384) for _ in range(rng.randint(20, 36))] for _ in range(n)]


def _metric(text: str, name: str) -> float:
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == name:
                return s.value
    raise KeyError(name)


async def _send_all(url: str, prompts: list[list[int]]) -> list[dict]:
    async with httpx.AsyncClient(base_url=url, timeout=300) as client:

        async def one(p: list[int]) -> dict:
            body = {"prompt": p, "max_tokens": MAX_TOKENS, "temperature": 0, "logprobs": 0}
            r = await client.post("/v1/completions", json=body)
            assert r.status_code == 200, r.text
            return r.json()

        return await asyncio.gather(*(one(p) for p in prompts))


def _gate(model, engine_ref: list, n: int) -> None:
    """Hold the model's forward until `n` requests have reached the engine, so all of them
    compete for the pool however the HTTP requests trickle in."""
    forward = model.forward_packed

    def gated(*args, **kwargs):
        deadline = time.monotonic() + 120
        while engine_ref[0].get_stats()["total_tasks"] < n and time.monotonic() < deadline:
            time.sleep(0.002)
        return forward(*args, **kwargs)

    model.forward_packed = gated


def _serve(model, tokenizer, pool: dict, prompts: list[list[int]]) -> tuple[list, float]:
    """(tokens and finish reason of each choice, preemptions in /metrics) of the prompts
    sent at once."""
    engine = InferenceEngine(model, tokenizer, max_batch_size=12, max_seq_len=128, **pool)
    _gate(model, [engine], len(prompts))
    with engine, ServerThread(create_app(engine)) as srv:
        out = asyncio.run(_send_all(srv.url, prompts))
        text = httpx.get(f"{srv.url}/metrics").text
        stats = engine.get_stats()
    choices = [
        (r["choices"][0]["logprobs"]["tokens"], r["choices"][0]["finish_reason"]) for r in out
    ]
    preempted = _metric(text, "astrai_preemptions_total")
    assert preempted == stats["preemptions"]
    assert _metric(text, "astrai_http_requests_total") == len(prompts)
    return choices, preempted


def test_preemption_is_counted_in_metrics_and_changes_no_output(model_dir, tokenizer):
    prompts = _prompts(12, seed=26)
    small, preempted = _serve(
        AutoModel.from_pretrained(model_dir).eval(), tokenizer, SMALL, prompts
    )
    assert preempted > 0
    ample, none = _serve(AutoModel.from_pretrained(model_dir).eval(), tokenizer, AMPLE, prompts)
    assert none == 0
    assert small == ample
    assert sum(len(tokens) for tokens, _ in small) > 240  # more than the small pool holds
