"""Preemption when the paged KV pool runs out while decoding: nothing is lost, nothing repeats.

A pool that holds about three of the long requests gets twelve at once. References are
independent of the preemption path: greedy decoding by full recomputation of the dense
forward (`greedy_reference`), and the same requests on an engine with ample memory.
"""

import random

import pytest

from astrai.inference import InferenceEngine

MAX_TOKENS = 40
# ~3 requests of up to 36 + 40 tokens; page_size 1 has no prefix cache, page_size 4 has one.
SMALL_POOLS = {
    "paged-4-radix": dict(cache_mode="paged", page_size=4, kv_tokens=240),
    "paged-1": dict(cache_mode="paged", page_size=1, kv_tokens=240),
}


def _prompts(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(384) for _ in range(rng.randint(20, 36))] for _ in range(n)]


def _run(model, tokenizer, pool: dict, prompts, **sampling):
    """Submit everything at once; return (token ids, ids seen by the stream, reasons, stats)."""
    with InferenceEngine(
        model, tokenizer, max_batch_size=12, max_seq_len=128, start=False, **pool
    ) as eng:
        results, streamed = [], []
        for p in prompts:
            r = eng.submit(p, max_tokens=MAX_TOKENS, ignore_eos=True, **sampling)
            seen: list[int] = []
            inner = r.task.on_token

            def on_token(task, tok, lp, seen=seen, inner=inner):
                seen.append(tok)
                inner(task, tok, lp)

            r.task.on_token = on_token
            results.append(r)
            streamed.append(seen)
        eng.start()
        for r in results:
            r.wait_completion(timeout=300)
        eng.stop()
        assert eng.pool.all_free()
        stats = eng.get_stats()
    return [r.token_ids for r in results], streamed, [r.finish_reason for r in results], stats


@pytest.mark.parametrize("pool", sorted(SMALL_POOLS))
def test_twelve_long_requests_in_a_pool_for_three(model, tokenizer, pool, greedy_reference):
    prompts = _prompts(12, seed=26)  # top-2 logit gaps >= 9e-4: no near-ties
    ids, streamed, reasons, stats = _run(
        model, tokenizer, SMALL_POOLS[pool], prompts, temperature=0.0
    )
    assert stats["preemptions"] > 0
    assert reasons == ["length"] * 12
    assert streamed == ids  # the stream saw every token once, in order
    big, _, _, big_stats = _run(
        model,
        tokenizer,
        dict(cache_mode="paged", page_size=4, kv_tokens=4096),
        prompts,
        temperature=0.0,
    )
    assert big_stats["preemptions"] == 0
    assert ids == big
    assert ids == [greedy_reference(model, p, MAX_TOKENS) for p in prompts]


def test_seeded_sampling_survives_preemption(model, tokenizer):
    """A seeded request's generator stays with it across preemption: same draws."""
    prompts = _prompts(12, seed=22)
    small, streamed, _, stats = _run(
        model, tokenizer, SMALL_POOLS["paged-4-radix"], prompts, temperature=0.8, seed=123
    )
    assert stats["preemptions"] > 0 and streamed == small
    big, _, _, _ = _run(
        model,
        tokenizer,
        dict(cache_mode="paged", page_size=4, kv_tokens=4096),
        prompts,
        temperature=0.8,
        seed=123,
    )
    assert small == big


def test_run_batch_preempts_too(model, tokenizer, greedy_reference):
    prompts = _prompts(12, seed=23)
    with InferenceEngine(
        model,
        tokenizer,
        max_batch_size=12,
        max_seq_len=128,
        start=False,
        **SMALL_POOLS["paged-4-radix"],
    ) as eng:
        out = eng.run_batch(prompts, max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
        assert eng.get_stats()["preemptions"] > 0 and eng.pool.all_free()
    assert out == [greedy_reference(model, p, MAX_TOKENS) for p in prompts]


def test_a_request_that_cannot_fit_alone_is_aborted(model, tokenizer, greedy_reference):
    """48 KV slots: a 30-token prompt asking for 40 more can never finish; the short ones
    still do, and the engine stays ready."""
    rng = random.Random(24)
    long_prompt = [rng.randrange(384) for _ in range(30)]
    short = [[rng.randrange(384) for _ in range(5)] for _ in range(3)]
    with InferenceEngine(
        model,
        tokenizer,
        max_batch_size=4,
        max_seq_len=128,
        cache_mode="paged",
        page_size=4,
        kv_tokens=48,
    ) as eng:
        big = eng.submit(long_prompt, max_tokens=40, temperature=0.0, ignore_eos=True)
        small = [eng.submit(p, max_tokens=6, temperature=0.0, ignore_eos=True) for p in short]
        with pytest.raises(ValueError, match="alone"):
            big.wait_completion(timeout=120)
        for r, p in zip(small, short):
            r.wait_completion(timeout=120)
            assert r.token_ids == greedy_reference(model, p, 6)
        assert big.finish_reason == "aborted" and eng.ready
        assert big.token_ids == greedy_reference(model, long_prompt, len(big.token_ids))


def test_cancelling_a_preempted_request(model, tokenizer):
    prompts = _prompts(6, seed=25)
    with InferenceEngine(
        model,
        tokenizer,
        max_batch_size=6,
        max_seq_len=128,
        start=False,
        **SMALL_POOLS["paged-4-radix"],
    ) as eng:
        results = [
            eng.submit(p, max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True) for p in prompts
        ]
        while eng.get_stats()["preemptions"] == 0:
            eng.step()
        waiting = [r for r in results if r.task.preemptions and r.task.row is None]
        assert waiting and eng.cancel(waiting[0])
        while eng.scheduler.has_work():
            eng.step()
        assert waiting[0].finish_reason == "cancelled" and eng.pool.all_free()
        assert all(r.finish_reason == "length" for r in results if r is not waiting[0])
