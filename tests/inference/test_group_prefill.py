"""Group prefill (`SamplingParams.n`): a prompt's samples prefill it once.

With a prefix cache, the followers of a group wait until the leader's prefill completes,
then find its complete pages in the cache and prefill only the tail. References are
independent of that path: each sample run alone, seeded, on an engine with no prefix cache
(or on a contiguous one). The edge cases: a leader that ends or is preempted before its
prefill completes releases its followers; a rejected prompt rejects every sample alike;
cancellation, statistics and a failed loop see the held followers.
"""

from __future__ import annotations

import asyncio
import dataclasses
import random

import pytest

from astrai.inference import InferenceEngine, SamplingParams
from astrai.inference.cache import PagePool

PAGE = 16
PAGED = dict(cache_mode="paged", page_size=PAGE, max_seq_len=128, max_batch_size=8)
SAMPLING = SamplingParams(temperature=1.0, max_tokens=8, ignore_eos=True)
_rng = random.Random(7)
PROMPT = [_rng.randrange(384) for _ in range(40)]  # two full pages before its last token
OTHER = [_rng.randrange(384) for _ in range(20)]
SHARED = (len(PROMPT) - 1) // PAGE * PAGE  # 32: what each follower finds in the cache


def _engine(model, tokenizer, **options) -> InferenceEngine:
    return InferenceEngine(model, tokenizer, start=False, **{**PAGED, **options})


def _drain(eng: InferenceEngine, max_steps: int = 500) -> None:
    """Step on this thread until nothing is left; a held follower never released fails."""
    for _ in range(max_steps):
        if not eng.scheduler.has_work():
            return
        eng.step()
    raise AssertionError(f"work left after {max_steps} steps: {eng.get_stats()}")


def _n(n: int, **changes) -> SamplingParams:
    return dataclasses.replace(SAMPLING, n=n, **changes)


def _same(got, want) -> None:
    assert [r.token_ids for r in got] == [r.token_ids for r in want]
    assert [r.finish_reason for r in got] == [r.finish_reason for r in want]
    for a, b in zip(got, want):
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-5)


@pytest.fixture(scope="module")
def alone(model, tokenizer):
    """Samples 0..7 of PROMPT with seeds 11..18, each run alone without a prefix cache."""
    with _engine(model, tokenizer, prefix_cache=False) as eng:
        out = [
            eng.run_batch([PROMPT], SAMPLING, seed=11 + j, return_details=True)[0] for j in range(8)
        ]
        assert eng.get_stats()["cached_prompt_tokens"] == 0
    assert len({tuple(r.token_ids) for r in out}) > 1  # the seeds differ, so do the samples
    return out


# ---------------------------------------------------------------------- the shared prefill
def test_followers_prefill_only_the_tail_and_draw_as_if_alone(model, tokenizer, alone):
    with _engine(model, tokenizer) as eng:
        out = eng.run_batch([PROMPT], _n(8), seed=11, return_details=True)
        stats = eng.get_stats()
        assert eng.pool.all_free()
    assert stats["cached_prompt_tokens"] == 7 * SHARED
    assert stats["total_prompt_tokens"] == 8 * len(PROMPT)
    _same(out, alone)


def test_contiguous_mode_holds_nothing_and_draws_the_same(model, tokenizer, alone):
    with _engine(model, tokenizer, cache_mode="contiguous") as eng:
        results = eng.submit_group(PROMPT, _n(8, seed=11))
        stats = eng.get_stats()
        assert stats["held_followers"] == 0 and stats["waiting_queue"] == 8
        _drain(eng)
        assert eng.get_stats()["cached_prompt_tokens"] == 0
        assert eng.pool.all_free()
    _same(results, alone)


def test_run_batch_n_draws_the_seeds_of_the_expanded_list(model, tokenizer):
    """Result `i * n + j` is sample j of prompt i, seeded `seed + i * n + j`: a caller moving
    from `[p0] * n + [p1] * n` to `n` gets the same streams."""
    with _engine(model, tokenizer) as eng:
        grouped = eng.run_batch([PROMPT, OTHER], _n(3), seed=5, return_details=True)
    with _engine(model, tokenizer, prefix_cache=False) as eng:
        flat = eng.run_batch([PROMPT] * 3 + [OTHER] * 3, SAMPLING, seed=5, return_details=True)
    _same(grouped, flat)
    unseeded = SamplingParams(temperature=0.0, max_tokens=4, n=2)
    with _engine(model, tokenizer) as eng:
        assert eng.run_batch([PROMPT, OTHER], unseeded) == eng.run_batch(
            [PROMPT, PROMPT, OTHER, OTHER], dataclasses.replace(unseeded, n=1)
        )


@pytest.mark.parametrize(
    "length, options, held",
    [(40, {}, 7), (17, {}, 7), (16, {}, 0), (5, {}, 0), (40, {"cache_mode": "contiguous"}, 0)],
)
def test_followers_are_held_only_when_the_prompt_has_a_page_to_share(
    model, tokenizer, length, options, held
):
    with _engine(model, tokenizer, **options) as eng:
        eng.submit_group(PROMPT[:length], _n(8))
        stats = eng.get_stats()
        assert (stats["held_followers"], stats["waiting_queue"]) == (held, 8)
        eng.step()  # the leader's prefill completes: its followers are queued
        stats = eng.get_stats()
        assert stats["held_followers"] == 0
        _drain(eng)
        shared = (length - 1) // PAGE * PAGE if held else 0
        assert eng.get_stats()["cached_prompt_tokens"] == 7 * shared
        assert eng.pool.all_free()


def test_released_followers_go_to_the_front_of_the_queue(model, tokenizer):
    """One request row: the leader runs, a later prompt waits; once the leader's prefill
    completes its followers queue ahead of the later prompt, and find its pages."""
    with _engine(model, tokenizer, max_batch_size=1) as eng:
        group = eng.submit_group(PROMPT, _n(3))
        later = eng.submit(OTHER, SAMPLING)
        _drain(eng)
        order = sorted([*group, later], key=lambda r: r.task.first_token_at)
        assert order == [*group, later]
        assert eng.get_stats()["cached_prompt_tokens"] == 2 * SHARED


# ---------------------------------------------------------------------- the pool underneath
def test_pages_cached_while_their_rows_live_are_never_taken_from_them():
    """Random rows that index their pages when their prefill completes, grow, index again
    and end, in a pool small enough to evict all the time. Every row writes a marker per
    position (the same one for the same prefix, as real KV would be); every row's KV is
    still its own after every operation: no page a row references was ever handed out."""
    rng = random.Random(3)
    pool = PagePool(
        num_layers=1, num_kv_heads=1, head_dim=1, max_batch_size=6, max_seq_len=32,
        mode="paged", page_size=2, kv_tokens=40,
    )  # fmt: skip
    marks: dict[tuple[int, ...], float] = {}
    live: dict[int, list[int]] = {}

    def write(row: int, toks: list[int], start: int) -> None:
        for p in range(start, len(toks)):
            mark = marks.setdefault(tuple(toks[: p + 1]), float(len(marks) + 1))
            pool.k_buffer[0, int(pool.slot_table[row, p]), 0, 0] = mark

    def intact() -> bool:
        return all(
            float(pool.k_buffer[0, int(pool.slot_table[row, p]), 0, 0]) == marks[tuple(t[: p + 1])]
            for row, t in live.items()
            for p in range(len(t))
        )

    for _ in range(600):
        op = rng.random()
        if live and (op < 0.3 or len(live) == 6):  # a row ends: index its longer sequence
            row = rng.choice(list(live))
            pool.cache_task(row, live.pop(row))
            pool.free_task(row)
        elif live and op < 0.6:  # a row grows (decodes) a few tokens
            row = rng.choice(list(live))
            toks = live[row] + [rng.randint(0, 2) for _ in range(rng.randint(1, 4))]
            if pool.ensure(row, len(toks)):
                write(row, toks, len(live[row]))
                live[row] = toks
        else:  # a new row: prefill, then index its pages at once (it keeps them)
            toks = [rng.randint(0, 2) for _ in range(rng.randint(2, 12))]
            got = pool.alloc_task(toks)
            if got is None:
                continue
            row, cached = got
            if not pool.ensure(row, len(toks)):
                pool.free_task(row)
                continue
            write(row, toks, cached)
            pool.cache_task(row, toks)
            live[row] = toks
        assert intact()
    for row in list(live):
        pool.cache_task(row, live.pop(row))
        pool.free_task(row)
    assert pool.all_free()


# ---------------------------------------------------------------------- a leader that ends early
@pytest.mark.parametrize("steps_before", [0, 1])
def test_a_cancelled_leader_releases_its_followers(model, tokenizer, steps_before):
    with _engine(model, tokenizer, max_prefill_tokens=8) as eng:
        results = eng.submit_group(PROMPT, _n(4))
        for _ in range(steps_before):  # 1: the leader is mid-prefill (8 of 40 tokens)
            eng.step()
        assert eng.get_stats()["held_followers"] == 3
        assert eng.cancel(results[0])
        _drain(eng)
        assert [r.finish_reason for r in results] == ["cancelled"] + ["length"] * 3
        assert all(len(r.token_ids) == SAMPLING.max_tokens for r in results[1:])
        assert eng.pool.all_free()


def test_an_aborted_leader_releases_its_followers(model, tokenizer, monkeypatch):
    with _engine(model, tokenizer) as eng:
        results = eng.submit_group(PROMPT, _n(3))

        def broken(plan):
            raise RuntimeError("device lost")

        with monkeypatch.context() as patch:
            patch.setattr(eng.runner, "run", broken)
            eng.step()  # the leader's prefill forward fails: it is aborted
        assert results[0].finish_reason == "aborted"
        _drain(eng)
        assert [r.finish_reason for r in results[1:]] == ["length"] * 2
        assert eng.pool.all_free()


def test_a_leader_preempted_mid_prefill_releases_its_followers(model, tokenizer):
    """A decoding request needs a page the pool no longer has: the newest running request,
    the leader still prefilling (4 tokens a step), is preempted, and its followers are
    queued behind it. (Pages of 4 tokens: the decoding request grows a page every 4 steps.)"""
    pool = dict(page_size=4, kv_tokens=14 * 4, max_prefill_tokens=4)
    with _engine(model, tokenizer, **pool) as eng:
        first = eng.submit(OTHER[:8], dataclasses.replace(SAMPLING, max_tokens=20))
        group = eng.submit_group(PROMPT, _n(3))
        for _ in range(20):
            eng.step()
            if group[0].task.preemptions:
                break
        assert group[0].task.preemptions == 1 and group[0].task.computed == 0
        stats = eng.get_stats()
        assert stats["held_followers"] == 0 and stats["waiting_queue"] == 3
        _drain(eng)
        assert [r.finish_reason for r in [first, *group]] == ["length"] * 4
        assert eng.pool.all_free()


def test_a_rejected_prompt_rejects_every_sample_alike(model, tokenizer):
    with _engine(model, tokenizer) as eng:
        for prompt, param in [([], "prompt"), (list(range(200)), "prompt")]:
            results = eng.submit_group(prompt, _n(3))
            assert [r.finish_reason for r in results] == ["rejected"] * 3
            rejections = {r.task.rejection for r in results}
            assert len(rejections) == 1 and rejections.pop().param == param
        assert not eng.scheduler.has_work()
        out = eng.run_batch([[], OTHER], _n(2), return_details=True)
        assert [r.finish_reason for r in out] == ["rejected"] * 2 + ["length"] * 2
        assert out[0].error == out[1].error == "empty prompt"


# ---------------------------------------------------------------------- held followers are seen
def test_cancel_stats_and_failure_see_held_followers(model, tokenizer):
    with _engine(model, tokenizer) as eng:
        results = eng.submit_group(PROMPT, _n(4))
        assert eng.scheduler.queue_full is False
        assert eng.cancel(results[2])  # held: found and cancelled
        _drain(eng)
        assert [r.finish_reason for r in results] == ["length", "length", "cancelled", "length"]
        results = eng.submit_group(PROMPT, _n(3))
        eng.scheduler.fail_all("boom")
        assert [r.finish_reason for r in results] == ["aborted"] * 3
        assert not eng.scheduler.has_work() and eng.pool.all_free()
    eng = _engine(model, tokenizer, max_queue=3)
    results = eng.submit_group(PROMPT, _n(3))
    assert eng.queue_full  # one queued + two held
    eng.shutdown()  # cancel_all, then cleanup: nothing stays held
    assert [r.finish_reason for r in results] == ["cancelled"] * 3
    assert not eng.scheduler.has_work()


def test_groups_under_kv_pressure_match_an_ample_pool(model, tokenizer):
    """Pages of 4 tokens, 28 of them, for 8 sequences of up to 64 tokens: requests are
    preempted and recomputed; every sample still draws what an ample pool gives it."""
    params = _n(4, max_tokens=24)
    with _engine(model, tokenizer, page_size=4, kv_tokens=28 * 4) as eng:
        small = eng.run_batch([PROMPT, OTHER], params, seed=3, return_details=True)
        stats = eng.get_stats()
        assert eng.pool.all_free()
    with _engine(model, tokenizer, page_size=4, kv_tokens=256 * 4) as eng:
        ample = eng.run_batch([PROMPT, OTHER], params, seed=3, return_details=True)
        assert eng.get_stats()["preemptions"] == 0
    assert stats["preemptions"] > 0
    _same(small, ample)


# ---------------------------------------------------------------------- the engine's API
def test_single_sequence_apis_refuse_n(model, tokenizer):
    with _engine(model, tokenizer) as eng:
        with pytest.raises(ValueError, match=r"^n must be 1 for submit .*submit_group"):
            eng.submit(PROMPT, SAMPLING, n=2)

        async def first_delta():
            return await anext(eng.generate_async(PROMPT, SAMPLING, n=2))

        with pytest.raises(ValueError, match=r"^n must be 1 for generate_async"):
            asyncio.run(first_delta())
        with pytest.raises(ValueError, match=r"^n must be 1 for score"):
            eng.score([([1, 2], [3])], SamplingParams(n=2))
        with pytest.raises(ValueError, match=r"^n must be an int in \[1, 16\]"):
            eng.submit_group(PROMPT, _n(17))
        assert not eng.scheduler.has_work()


@pytest.mark.parametrize("n", [0, 17, 1.5, True, "2"])
def test_n_is_checked_naming_it(n):
    with pytest.raises(ValueError, match=r"^n must be an int in \[1, 16\]"):
        SamplingParams(n=n).validate()


def test_generate_with_n(model, tokenizer):
    text = "def handler(request, response):\n    return request.body + response.body\n"
    other = "import os\n"
    kw = dict(max_tokens=6, ignore_eos=True, temperature=1.0)
    with InferenceEngine(model, tokenizer, **PAGED) as eng:
        assert len(tokenizer.encode(text)) > PAGE  # long enough to be held
        texts = eng.generate(text, n=3, seed=1, **kw)
        assert texts == [eng.generate(text, seed=1 + j, **kw) for j in range(3)]
        lists = eng.generate([text, other], n=2, seed=1, **kw)
        assert lists[0] == texts[:2] and len(lists[1]) == 2
        streamed = ["", "", "", ""]
        for i, delta in eng.generate([text, other], n=2, seed=1, stream=True, **kw):
            streamed[i] += delta
        assert streamed == [*lists[0], *lists[1]]
        assert eng.get_stats()["cached_prompt_tokens"] > 0
