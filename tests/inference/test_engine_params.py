"""One typed request from every entry point: `params=SamplingParams(...)` or its keywords, and
the one prompt check (with `max_prompt_tokens`) that tags what it rejects."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest

from astrai.inference import InferenceEngine, RequestRejected, SamplingParams

PROMPTS = [[5, 9, 11, 3], [7, 7, 2], [100, 42, 8, 15, 16, 23], [1, 2]]
SETTINGS = dict(  # fields the old run_batch had no keyword for, too
    max_tokens=5,
    temperature=0.9,
    top_k=40,
    min_p=0.02,
    presence_penalty=0.5,
    logit_bias={3: 2.0},
    logprobs_mode="scaled",
    ignore_eos=True,
)


def drain(eng: InferenceEngine) -> None:
    while eng.scheduler.has_work():
        eng.step()


def test_run_batch_params_equal_the_keywords_and_submit(model, tokenizer):
    params = SamplingParams(seed=11, **SETTINGS)
    with InferenceEngine(model, tokenizer, max_seq_len=64, start=False) as eng:
        typed = eng.run_batch(PROMPTS, params, return_details=True)
        keywords = eng.run_batch(PROMPTS, seed=11, return_details=True, **SETTINGS)
        seed_kw = eng.run_batch(PROMPTS, dataclasses.replace(params, seed=None), seed=11)
        other_seed = eng.run_batch(PROMPTS, params, seed=12)
        one_by_one = [eng.submit(p, params, seed=11 + i) for i, p in enumerate(PROMPTS)]
        drain(eng)
    assert [r.token_ids for r in typed] == [r.token_ids for r in keywords] == seed_kw
    assert [r.logprobs for r in typed] == [r.logprobs for r in keywords]
    assert [r.token_ids for r in one_by_one] == seed_kw  # prompt i draws with seed + i
    assert [r.logprobs for r in one_by_one] == [r.logprobs for r in typed]
    assert other_seed != seed_kw


def test_generate_and_generate_async_take_params(model, tokenizer):
    greedy = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)

    async def collect(eng: InferenceEngine) -> str:
        return "".join([d async for d in eng.generate_async("def f", greedy)])

    with InferenceEngine(model, tokenizer, max_seq_len=64) as eng:
        text = eng.generate("def f", greedy)
        assert text == eng.generate("def f", max_tokens=4, temperature=0.0, ignore_eos=True)
        assert eng.generate(["def f"], greedy) == [text]
        assert asyncio.run(collect(eng)) == text
        with pytest.raises(TypeError, match=r"^params must be a SamplingParams, got dict"):
            eng.submit("def f", {"max_tokens": 2})


def test_score_takes_prompt_logprobs_from_params(model, tokenizer):
    requests = [([5, 9, 11], [3, 4]), ([7, 7], [2])]
    with InferenceEngine(model, tokenizer, max_seq_len=64, start=False) as eng:
        typed = eng.score(requests, SamplingParams(prompt_logprobs=2, temperature=0.3))
        keyword = eng.score(requests, top_logprobs=2)
        override = eng.score(requests, SamplingParams(prompt_logprobs=5), top_logprobs=2)
        plain = eng.score(requests)
    assert typed == keyword == override
    assert all(len(t.top) == 2 for r in typed for t in r.tokens)
    assert [r.logprob for r in plain] == [r.logprob for r in typed]
    assert all(t.top == () for r in plain for t in r.tokens)


def test_max_prompt_tokens_rejects_one_token_over_the_limit(model, tokenizer):
    ok = SamplingParams(max_tokens=4, ignore_eos=True)  # a sampled EOS would end it "stop"
    with InferenceEngine(model, tokenizer, max_seq_len=64, max_prompt_tokens=10) as eng:
        assert eng.max_prompt_tokens == 10
        eng.check_request(list(range(1, 11)), ok)  # exactly at the limit
        with pytest.raises(RequestRejected) as info:
            eng.check_request(list(range(1, 12)), ok)
        assert str(info.value) == (
            "prompt is too long: 11 tokens, the limit is 10 (max_prompt_tokens)"
        )
        assert info.value.param == "prompt"
        over = eng.submit(list(range(1, 12)), ok)
        assert over.finish_reason == "rejected" and over.task.error_param == "prompt"
        at, past = eng.run_batch([list(range(1, 11)), list(range(1, 12))], ok, return_details=True)
        assert at.finish_reason == "length" and past.finish_reason == "rejected"
        with pytest.raises(ValueError, match=r"^request 1: prompt is too long: 11 tokens"):
            eng.score([([1, 2], [3]), (list(range(1, 8)), [1, 2, 3, 4])])
    with pytest.raises(ValueError, match=r"^max_prompt_tokens must be a positive int"):
        InferenceEngine(model, tokenizer, max_prompt_tokens=0, start=False)


@pytest.mark.parametrize(
    ("ids", "settings", "param", "message"),
    [
        ([], {}, "prompt", "empty prompt"),
        (list(range(64)), {}, "prompt", "prompt is too long: 64 tokens, the limit is 63 (the "),
        ([1, 384], {}, "prompt", "token id(s) outside the vocabulary [0, 384): [384]"),
        ([1, 2], {"max_tokens": 0}, "max_tokens", "max_tokens must be positive"),
        (
            [1, 2, 3],
            {"max_tokens": 0, "prompt_logprobs": 0, "prompt_logprobs_start": 3},
            "prompt_logprobs_start",
            "prompt_logprobs_start (3) must be below the prompt length (3)",
        ),
        (
            [1, 2, 3],
            {"max_tokens": 62, "max_tokens_policy": "error"},
            "max_tokens",
            "maximum context length is 64 tokens, but 65 were requested",
        ),
    ],
)
def test_every_prompt_rejection_is_tagged(model, tokenizer, ids, settings, param, message):
    params = SamplingParams(**settings)
    with InferenceEngine(model, tokenizer, max_seq_len=64, start=False) as eng:
        with pytest.raises(RequestRejected) as info:
            eng.check_request(ids, params)
        assert info.value.param == param and message in str(info.value)
        result = eng.submit(ids, params)
        assert result.finish_reason == "rejected"
        assert result.task.error_param == param and message in result.task.error
