"""Every builder hands the engine one ready `SamplingParams`, with its protocol's defaults
applied once, by `astrai.serve.request` (no builder spells a sampling default itself)."""

from __future__ import annotations

import inspect

import pytest

from astrai.inference import SamplingParams
from astrai.serve import anthropic_builder, completions_builder, openai_builder
from astrai.serve.anthropic_builder import AnthropicResponseBuilder
from astrai.serve.completions_builder import CompletionsResponseBuilder
from astrai.serve.openai_builder import OpenAIResponseBuilder
from astrai.serve.protocol import Prepared
from astrai.serve.schemas import ChatCompletionRequest, CompletionRequest, MessagesRequest
from astrai.serve.settings import ServeSettings

HI = [{"role": "user", "content": "hi"}]
ENDPOINTS = {
    "chat": (OpenAIResponseBuilder, ChatCompletionRequest, {"messages": HI}),
    "completions": (CompletionsResponseBuilder, CompletionRequest, {"prompt": "def main("}),
    "messages": (AnthropicResponseBuilder, MessagesRequest, {"messages": HI}),
}
# The protocols' own defaults: the value a field left out (or sent as null) stands for.
TOP_K = {"chat": 50, "completions": 0, "messages": 50}
MAX_TOKENS = {"chat": 2048, "completions": 16, "messages": 1024}


def prepared(tokenizer, endpoint: str, settings: ServeSettings | None = None, **fields) -> Prepared:
    builder, schema, base = ENDPOINTS[endpoint]
    body = schema.model_validate({**base, **fields})
    return builder().prepare(body, tokenizer, settings or ServeSettings())


@pytest.mark.parametrize("endpoint", ENDPOINTS)
def test_a_builder_returns_one_ready_sampling_params(tokenizer, endpoint):
    params = prepared(tokenizer, endpoint).params
    assert isinstance(params, SamplingParams)
    assert params.validate(vocab_size=tokenizer.vocab_size) is params
    assert (params.temperature, params.top_p, params.top_k) == (1.0, 1.0, TOP_K[endpoint])
    assert params.max_tokens == MAX_TOKENS[endpoint]
    assert params.max_tokens_policy == "clamp"  # a default max_tokens is capped to the context


@pytest.mark.parametrize("endpoint", ENDPOINTS)
def test_top_p_zero_is_greedy_in_every_protocol(tokenizer, endpoint):
    params = prepared(tokenizer, endpoint, temperature=0.7, top_p=0).params
    assert params.greedy and (params.temperature, params.top_p) == (0.0, 1.0)
    kept = prepared(tokenizer, endpoint, temperature=0.7, top_p=0.5).params
    assert (kept.temperature, kept.top_p) == (0.7, 0.5)


@pytest.mark.parametrize("endpoint", ENDPOINTS)
def test_null_takes_the_protocol_default(tokenizer, endpoint):
    params = prepared(tokenizer, endpoint, temperature=None, top_p=None, top_k=None).params
    assert (params.temperature, params.top_p, params.top_k) == (1.0, 1.0, TOP_K[endpoint])
    assert prepared(tokenizer, endpoint, top_k=7).params.top_k == 7


@pytest.mark.parametrize("endpoint", ENDPOINTS)
def test_an_explicit_max_tokens_follows_the_server_policy(tokenizer, endpoint):
    clamp = ServeSettings(max_tokens_policy="clamp")
    explicit = prepared(tokenizer, endpoint, max_tokens=5)
    assert explicit.params.max_tokens == 5 and explicit.params.max_tokens_policy == "error"
    assert explicit.max_tokens_param == "max_tokens"
    assert prepared(tokenizer, endpoint, clamp, max_tokens=5).params.max_tokens_policy == "clamp"


def test_openai_settings_and_stops(tokenizer):
    fields = dict(
        min_p=0.1,
        presence_penalty=0.5,
        frequency_penalty=-0.5,
        logit_bias={5: 2.0},
        seed=2**70,
        stop=["", "END"],
    )
    for endpoint in ("chat", "completions"):
        p = prepared(tokenizer, endpoint, **fields)
        params = p.params
        assert (params.min_p, params.presence_penalty, params.frequency_penalty) == (0.1, 0.5, -0.5)
        assert dict(params.logit_bias) == {5: 2.0} and params.seed == 2**70
        assert p.stops == ["END"]  # an empty stop string would match at once
        null = prepared(tokenizer, endpoint, min_p=None, presence_penalty=None, logit_bias={})
        assert (null.params.min_p, null.params.presence_penalty) == (0.0, 0.0)
        assert null.params.logit_bias is None
    chat = prepared(tokenizer, "chat", max_completion_tokens=9, max_tokens=5)
    assert chat.params.max_tokens == 9 and chat.max_tokens_param == "max_completion_tokens"
    assert prepared(tokenizer, "chat", stop="END").stops == ["END"]
    assert prepared(tokenizer, "messages", stop_sequences=["", "END"]).stops == ["END"]


def test_no_builder_spells_a_sampling_default():
    """The defaults live in `astrai.serve.request` once: were a builder to apply one of its
    own, the protocols could drift apart again."""
    for module in (openai_builder, completions_builder, anthropic_builder):
        source = inspect.getsource(module)
        for name in ("top_p", "top_k", "temperature", "min_p", "presence_penalty"):
            assert name not in source, f"{module.__name__} handles {name} itself"
