"""Log-probs that JSON cannot carry: -inf is sent as vLLM's -9999.0, and a model whose
logits went NaN gets a 500 in the protocol's error shape (plain, or an error event that
ends the stream), never a serialization crash or a stream with `NaN` in it."""

from __future__ import annotations

import json
import math

import httpx
import openai
import pytest
import torch

from astrai.inference import InferenceEngine
from astrai.model import AutoModel
from astrai.serve import ServerThread, ServeSettings, create_app
from astrai.serve.logprobs import MIN_LOGPROB, LegacyLogprobs, chat_entries, token_text

MSGS = [{"role": "user", "content": "hi"}]
ROUTES = {
    "/v1/chat/completions": {"messages": MSGS, "logprobs": True, "top_logprobs": 2},
    "/v1/completions": {"prompt": "hi", "logprobs": 2},
}


@pytest.fixture(scope="module")
def nan_url(model_dir, tokenizer):
    """A server whose model's vocabulary projection has NaN rows: every log-prob is NaN."""
    model = AutoModel.from_pretrained(model_dir)
    with torch.no_grad():
        model.lm_head.weight[5:9] = float("nan")
    engine = InferenceEngine(
        model, tokenizer, max_batch_size=4, max_seq_len=256, cache_mode="contiguous"
    )
    try:
        with ServerThread(create_app(engine, ServeSettings())) as srv:
            yield srv.url
    finally:
        engine.shutdown()


def _is_the_error(err: dict) -> None:
    assert set(err) == {"message", "type", "param", "code"}
    assert err["type"] == "invalid_request_error" and err["code"] == "non_finite_logprob"
    assert err["param"] == "logprobs" and "nan" in err["message"]


@pytest.mark.parametrize("path", list(ROUTES))
def test_nan_logprobs_are_a_protocol_error_plain_and_streamed(nan_url, path):
    body = {"model": "astrai", "max_tokens": 4, **ROUTES[path]}
    r = httpx.post(nan_url + path, json=body, timeout=60)
    assert r.status_code == 422, r.text
    _is_the_error(r.json()["error"])
    with httpx.stream("POST", nan_url + path, json={**body, "stream": True}, timeout=60) as r:
        assert r.status_code == 200
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    payloads = [json.loads(e) for e in events[:-1]]  # every event is valid JSON: no NaN
    _is_the_error(payloads[-1]["error"])
    assert not any("error" in p for p in payloads[:-1])
    # The same request without log-probs is answered: the server goes on serving.
    plain = {k: v for k, v in body.items() if k not in ("logprobs", "top_logprobs")}
    assert httpx.post(nan_url + path, json=plain, timeout=60).status_code == 200


def test_the_openai_sdk_raises_its_api_error(nan_url):
    client = openai.OpenAI(base_url=f"{nan_url}/v1", api_key="x", max_retries=0, timeout=60)
    kwargs = dict(model="astrai", messages=MSGS, max_tokens=4, logprobs=True)
    with pytest.raises(openai.UnprocessableEntityError, match="not finite"):
        client.chat.completions.create(**kwargs)
    with pytest.raises(openai.APIError, match="not finite"):
        list(client.chat.completions.create(stream=True, **kwargs))
    with pytest.raises(openai.UnprocessableEntityError, match="not finite"):
        client.completions.create(model="astrai", prompt="hi", max_tokens=4, logprobs=1)
    client.close()


def test_minus_infinity_is_vllms_floor(tokenizer):
    """A token the model rules out (log-prob -inf) is sent as -9999.0, the value vLLM and
    OpenAI use, in both shapes; finite values pass unchanged."""
    tt = token_text(tokenizer)
    a, b = tokenizer.encode("ab")[:2]
    [entry] = chat_entries(tt, [a], [-0.5], [[(a, -0.5), (b, -math.inf)]])
    assert entry["logprob"] == -0.5
    assert [t["logprob"] for t in entry["top_logprobs"]] == [-0.5, MIN_LOGPROB]
    legacy = LegacyLogprobs(tt).build([a, b], [-1.0, -math.inf], [[(b, -math.inf)], []], text_len=2)
    assert legacy["token_logprobs"] == [-1.0, MIN_LOGPROB]
    assert legacy["top_logprobs"][0] == {tt.text(b): MIN_LOGPROB, tt.text(a): -1.0}
    json.dumps(legacy, allow_nan=False)  # valid JSON
