"""Prompt log-probs, `score()` and generated-token top alternatives against the model's own
dense training forward (`model(input_ids)`, log_softmax, gather), fp32 on the CPU."""

import random

import pytest
import torch

from astrai.inference import InferenceEngine, SamplingParams, ScoreResult, TokenLogprob

TOL = dict(atol=1e-5, rtol=0)
K = 3

ENGINES = {
    "contiguous": dict(cache_mode="contiguous"),
    "paged": dict(cache_mode="paged", page_size=4, kv_tokens=4096),
    # Both boundaries crossed: prefill chunks of 7 tokens, lm_head slices of 3 positions.
    "chunked-contiguous": dict(max_prefill_tokens=7, logprob_chunk=3),
    "chunked-paged": dict(
        cache_mode="paged", page_size=4, kv_tokens=4096, max_prefill_tokens=7, logprob_chunk=3
    ),
}


def random_ids(n: int, rng: random.Random, vocab: int = 384) -> list[int]:
    return [rng.randrange(vocab) for _ in range(n)]


def dense(model, ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference logits and log_softmax `[len(ids), vocab]` of the training forward."""
    with torch.no_grad():
        logits = model(torch.tensor([ids]))[0].float()
    return logits, torch.log_softmax(logits, -1)


def assert_matches_reference(model, ids: list[int], entries, start: int, k: int) -> None:
    """`entries[p]` scores `ids[p]` from the reference's position p - 1, for p >= start."""
    assert entries is not None and len(entries) == len(ids)
    assert all(e is None for e in entries[:start])
    logits, logp = dense(model, ids)
    scored = entries[start:]
    assert all(isinstance(e, TokenLogprob) for e in scored)
    assert [e.token_id for e in scored] == ids[start:]
    target = torch.tensor(ids[start:])
    ref = logp[start - 1 : -1]
    got = torch.tensor([e.logprob for e in scored])
    torch.testing.assert_close(got, ref.gather(1, target[:, None])[:, 0], **TOL)
    assert [e.greedy for e in scored] == (logits[start - 1 : -1].argmax(-1) == target).tolist()
    top = ref.topk(k, dim=-1)
    for e, ids_ref, vals_ref in zip(scored, top.indices.tolist(), top.values):
        assert [t for t, _ in e.top] == ids_ref
        torch.testing.assert_close(torch.tensor([v for _, v in e.top]), vals_ref, **TOL)


def drain(eng: InferenceEngine) -> None:
    while eng.scheduler.has_work():
        eng.step()


@pytest.mark.parametrize("name", sorted(ENGINES))
def test_prompt_logprobs_equal_the_training_forward(model, tokenizer, greedy_reference, name):
    rng = random.Random(0)
    ps = [random_ids(n, rng) for n in (9, 23, 31, 16, 40)]
    starts = [1, 5, 1, 15, 2]
    max_tokens = [0, 3, 0, 2, 0]
    with InferenceEngine(
        model, tokenizer, max_batch_size=8, max_seq_len=64, start=False, **ENGINES[name]
    ) as eng:
        results = [
            eng.submit(
                p,
                max_tokens=m,
                temperature=0.0,
                ignore_eos=True,
                prompt_logprobs=K,
                prompt_logprobs_start=s,
            )
            for p, s, m in zip(ps, starts, max_tokens)
        ]
        plain = eng.submit(ps[1], max_tokens=4, temperature=0.0, ignore_eos=True)
        drain(eng)
        if "chunked" in name:  # several prefill steps, so chunks end inside the prompts
            assert eng.get_stats()["steps"] >= sum(map(len, ps)) // 7
    for p, s, m, r in zip(ps, starts, max_tokens, results):
        assert r.finish_reason == "length" and len(r.token_ids) == m
        assert_matches_reference(model, p, r.prompt_logprobs, s, K)
        if m:  # sampling rows of a scoring request generate as usual
            assert r.token_ids == greedy_reference(model, p, m)
    assert plain.prompt_logprobs is None and plain.token_ids == greedy_reference(model, ps[1], 4)


def test_prefix_cache_hit_only_before_the_first_scored_position(model, tokenizer):
    """The radix cache may serve positions < start - 1 only; scores stay exact."""
    rng = random.Random(1)
    prefix = random_ids(12, rng)  # three pages of 4
    prompt = [*prefix, *random_ids(8, rng)]
    with InferenceEngine(
        model, tokenizer, cache_mode="paged", page_size=4, kv_tokens=4096, start=False
    ) as eng:
        eng.run_batch([prefix], max_tokens=2, temperature=0.0, ignore_eos=True)

        def score_from(start: int) -> tuple[list, int]:
            before = eng.get_stats()["cached_prompt_tokens"]
            r = eng.submit(prompt, max_tokens=0, prompt_logprobs=K, prompt_logprobs_start=start)
            drain(eng)
            assert r.finish_reason == "length" and r.token_ids == []
            return r.prompt_logprobs, eng.get_stats()["cached_prompt_tokens"] - before

        entries, cached = score_from(10)  # limit 9 tokens: two whole pages
        assert cached == 8
        assert_matches_reference(model, prompt, entries, 10, K)
        entries, cached = score_from(13)  # limit 12: three pages
        assert cached == 12
        assert_matches_reference(model, prompt, entries, 13, K)
        entries, cached = score_from(1)  # position 0 scores token 1: nothing from the cache
        assert cached == 0
        assert_matches_reference(model, prompt, entries, 1, K)
        assert eng.pool.all_free()


def lm_eval_like(seed: int) -> list[tuple[list[int], list[int]]]:
    """Three questions (contexts of 2-4 pages) with three choices each, interleaved."""
    rng = random.Random(seed)
    contexts = [random_ids(n, rng) for n in (10, 13, 17)]
    return [(c, random_ids(rng.randint(1, 5), rng)) for _ in range(3) for c in contexts]


def test_score_equals_the_reference_and_shares_contexts(model, tokenizer):
    requests = lm_eval_like(2)
    paged = dict(cache_mode="paged", page_size=4, kv_tokens=4096)
    with InferenceEngine(model, tokenizer, start=False, **paged) as eng:
        shared = eng.score(requests, top_logprobs=2, progress=True)
        stats = eng.get_stats()
        assert stats["total_tasks"] == len(requests) and eng.pool.all_free()
        # each choice after the first reuses its context's whole pages before start - 1
        assert stats["cached_prompt_tokens"] == 3 * (8 + 12 + 16) - 8 - 12 - 16
    with InferenceEngine(model, tokenizer, start=False, prefix_cache=False, **paged) as eng:
        unshared = eng.score(requests, top_logprobs=2)
        assert eng.get_stats()["cached_prompt_tokens"] == 0
    for (context, continuation), a, b in zip(requests, shared, unshared):
        assert isinstance(a, ScoreResult)
        logits, logp = dense(model, context + continuation)
        n = len(context)
        target = torch.tensor(continuation)
        ref = logp[n - 1 : -1].gather(1, target[:, None])[:, 0]
        assert [t.token_id for t in a.tokens] == continuation
        assert a.logprob == pytest.approx(float(ref.sum()), abs=1e-5)
        assert a.greedy == bool((logits[n - 1 : -1].argmax(-1) == target).all())
        assert a.logprob == pytest.approx(b.logprob, abs=1e-5) and a.greedy == b.greedy
        assert [len(t.top) for t in a.tokens] == [2] * len(continuation)


def test_score_greedy_flag_is_true_for_the_greedy_continuation(model, tokenizer, greedy_reference):
    context = [5, 9, 2, 7, 1, 3]
    greedy = greedy_reference(model, context, 4)
    other = [*greedy[:3], (greedy[3] + 1) % 384]
    with InferenceEngine(model, tokenizer, start=False) as eng:
        a, b = eng.score([(context, greedy), (context, other)])
    assert a.greedy and not b.greedy
    assert [t.greedy for t in b.tokens] == [True, True, True, False]


def test_score_rejects_bad_requests_by_index_before_any_work(model, tokenizer):
    good = ([1, 2, 3], [4])
    cases = [
        (([], [4]), r"request 1: context is empty"),
        (([1, 2], []), r"request 1: continuation is empty"),
        (([1] * 40, [2] * 25), r"request 1: too long: 65 tokens"),
        (([1, 384], [2]), r"request 1: context token id\(s\) outside the vocabulary"),
        (([1, 2], [-1]), r"request 1: continuation token id\(s\) outside"),
        (([1, 2],), r"request 1: expected a \(context_ids, continuation_ids\) pair"),
        (("ab", [2]), r"request 1: context must be a list of token ids"),
    ]
    with InferenceEngine(model, tokenizer, max_seq_len=64) as eng:  # loop running
        for bad, match in cases:
            with pytest.raises(ValueError, match=match):
                eng.score([good, bad, good])
        with pytest.raises(ValueError, match="top_logprobs"):
            eng.score([good], top_logprobs=21)
        assert eng.get_stats()["total_tasks"] == 0  # nothing ran
        (res,) = eng.score([([1] * 40, [2] * 24)])  # exactly max_seq_len tokens
        assert len(res.tokens) == 24 and eng.ready
        assert eng.generate("def f", max_tokens=2, temperature=0.0, ignore_eos=True)


@pytest.mark.parametrize("k", [1, 5])
def test_generated_top_logprobs_equal_the_training_forward(model, tokenizer, k):
    prompt = [5, 9, 2, 7, 1]
    with InferenceEngine(model, tokenizer, start=False) as eng:
        r = eng.submit(prompt, max_tokens=4, temperature=0.0, ignore_eos=True, logprobs=k)
        plain = eng.submit(prompt, max_tokens=4, temperature=0.0, ignore_eos=True)
        drain(eng)
    assert_generated_top(model, prompt, r, k)
    assert plain.top_logprobs == [] and plain.token_ids == r.token_ids


def assert_generated_top(model, prompt, r, k: int) -> None:
    ids = r.token_ids
    _, logp = dense(model, prompt + ids)
    ref = logp[len(prompt) - 1 : -1]
    chosen = ref.gather(1, torch.tensor(ids)[:, None])[:, 0]
    torch.testing.assert_close(torch.tensor(r.logprobs), chosen, **TOL)
    assert len(r.top_logprobs) == len(ids)
    top = ref.topk(k, dim=-1)
    for alts, want_ids, want_vals, tok, lp in zip(
        r.top_logprobs, top.indices.tolist(), top.values, ids, r.logprobs
    ):
        assert [t for t, _ in alts] == want_ids and alts[0] == (tok, pytest.approx(lp))
        torch.testing.assert_close(torch.tensor([v for _, v in alts]), want_vals, **TOL)


@pytest.mark.slow
def test_generated_top_logprobs_through_the_graph_stand_in(model, tokenizer, monkeypatch):
    from astrai.extension import attn_backend

    if not torch.cuda.is_available():
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    prompt = [3, 1, 4, 1, 5, 9]
    eng = InferenceEngine(
        model, tokenizer, start=False, cache_mode="paged", page_size=4, decode_graphs="stand-in"
    )
    with eng, attn_backend("triton"):
        r = eng.submit(prompt, max_tokens=4, temperature=0.0, ignore_eos=True, logprobs=3)
        drain(eng)
        assert sum(eng.graph_runner.replays.values()) >= 3
    assert_generated_top(model, prompt, r, 3)


def test_score_only_requests_need_prompt_logprobs_and_name_the_field(model, tokenizer):
    with InferenceEngine(model, tokenizer, max_seq_len=64, start=False) as eng:
        with pytest.raises(ValueError, match=r"^max_tokens must be positive"):
            eng.check_request([1, 2, 3], SamplingParams(max_tokens=0))
        eng.check_request([1, 2, 3], SamplingParams(max_tokens=0, prompt_logprobs=0))
        eng.check_request([1] * 64, SamplingParams(max_tokens=0, prompt_logprobs=0))
        with pytest.raises(ValueError, match="prompt is too long"):
            eng.check_request([1] * 64, SamplingParams(max_tokens=1, prompt_logprobs=0))
        with pytest.raises(ValueError, match=r"^prompt_logprobs_start"):
            eng.check_request([1, 2, 3], SamplingParams(prompt_logprobs=0, prompt_logprobs_start=3))
        with pytest.raises(ValueError, match=r"^logprobs must be an int in"):
            eng.submit([1, 2], logprobs=21)
        with pytest.raises(ValueError, match=r"^prompt_logprobs must be"):
            eng.submit([1, 2], prompt_logprobs=21)
        rejected = eng.submit([1, 2, 3], max_tokens=0)
        assert rejected.finish_reason == "rejected" and "max_tokens" in rejected.task.error
        (out,) = eng.run_batch([[1, 2, 3]], max_tokens=0, return_details=True)
        assert out.finish_reason == "rejected"
