"""`best_of > n` on `/v1/completions` (astrai.serve.best_of), through the real `openai`
client: the answer is the `n` samples with the highest cumulative log-prob among the
`best_of` the same seed draws, most likely first.

The reference is the server's own plain sampling: the same request with `n = best_of` and
no `best_of` returns every sample (sample j is seeded `seed + j` either way) with its
tokens' log-probs; its top `n` by summed log-prob, computed here, must be the answer. The
end token is biased away so that every sample reports all of its tokens' log-probs.
"""

from __future__ import annotations

import openai
import pytest

PROMPTS = ["The tide came in and", "Once, in a small town,"]


def _create(oai: openai.OpenAI, tokenizer, **kwargs):
    end = tokenizer.token_to_id("<|im_end|>")
    return oai.completions.create(
        model="astrai",
        max_tokens=6,
        temperature=1.0,
        logprobs=0,
        logit_bias={str(end): -100},
        **kwargs,
    )


def _ranked(choices, n_per_prompt: int, samples: int) -> list[list[str]]:
    """Per prompt, the texts of the `n_per_prompt` samples with the highest summed log-prob."""
    out = []
    for p in range(len(choices) // samples):
        group = sorted(choices[p * samples : (p + 1) * samples], key=lambda c: c.index)
        for c in group:
            assert len(c.logprobs.token_logprobs) == 6  # every token's log-prob is reported
        ranked = sorted(group, key=lambda c: sum(c.logprobs.token_logprobs), reverse=True)
        out.append([c.text for c in ranked[:n_per_prompt]])
    return out


@pytest.mark.parametrize(("seed", "n", "best_of"), [(11, 1, 4), (12, 2, 5), (13, 3, 4)])
def test_best_of_returns_the_top_n_by_cumulative_logprob(oai, tokenizer, seed, n, best_of):
    every = _create(oai, tokenizer, prompt=PROMPTS[0], n=best_of, seed=seed)
    want = _ranked(every.choices, n, best_of)[0]
    assert len(set(c.text for c in every.choices)) > n  # the choice is not trivial
    got = _create(oai, tokenizer, prompt=PROMPTS[0], n=n, best_of=best_of, seed=seed)
    assert [c.index for c in got.choices] == list(range(n))
    assert [c.text for c in got.choices] == want
    sums = [sum(c.logprobs.token_logprobs) for c in got.choices]
    assert sums == sorted(sums, reverse=True)
    assert got.usage.completion_tokens == 6 * n  # the returned choices' tokens


def test_best_of_per_prompt_of_a_batch(oai, tokenizer):
    every = _create(oai, tokenizer, prompt=PROMPTS, n=3, seed=21)
    want = _ranked(every.choices, 1, 3)
    got = _create(oai, tokenizer, prompt=PROMPTS, n=1, best_of=3, seed=21)
    assert [c.index for c in got.choices] == [0, 1]
    assert [[c.text] for c in got.choices] == want


def test_best_of_equal_to_n_is_plain_sampling(oai, tokenizer):
    plain = _create(oai, tokenizer, prompt=PROMPTS[0], n=2, seed=5)
    same = _create(oai, tokenizer, prompt=PROMPTS[0], n=2, best_of=2, seed=5)
    assert [c.text for c in same.choices] == [c.text for c in plain.choices]


@pytest.mark.parametrize(
    ("kwargs", "words"),
    [
        ({"n": 3, "best_of": 2}, "at least n"),
        ({"n": 1, "best_of": 2, "stream": True}, "cannot stream"),
    ],
)
def test_bad_best_of_is_a_400_naming_it(oai, tokenizer, kwargs, words):
    with pytest.raises(openai.BadRequestError) as err:
        _create(oai, tokenizer, prompt=PROMPTS[0], **kwargs)
    assert err.value.body["param"] == "best_of"
    assert words in err.value.body["message"]


def _chat(oai: openai.OpenAI, **kwargs):
    return oai.chat.completions.create(
        model="astrai",
        messages=[{"role": "user", "content": "Tell me something."}],
        max_tokens=6,
        temperature=1.0,
        logprobs=True,
        **kwargs,
    )


@pytest.mark.parametrize(("seed", "n", "best_of"), [(31, 1, 4), (32, 2, 4)])
def test_chat_best_of_returns_the_top_n_by_cumulative_logprob(oai, seed, n, best_of):
    every = _chat(oai, n=best_of, seed=seed)
    ranked = sorted(
        every.choices, key=lambda c: sum(e.logprob for e in c.logprobs.content), reverse=True
    )
    assert len(set(c.message.content for c in every.choices)) > n
    got = _chat(oai, n=n, seed=seed, extra_body={"best_of": best_of})
    assert [c.index for c in got.choices] == list(range(n))
    assert [c.message.content for c in got.choices] == [c.message.content for c in ranked[:n]]


def test_chat_best_of_below_n_is_a_400_naming_it(oai):
    with pytest.raises(openai.BadRequestError) as err:
        _chat(oai, n=2, extra_body={"best_of": 1})
    assert err.value.body["param"] == "best_of"
