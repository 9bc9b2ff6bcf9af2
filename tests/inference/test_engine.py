"""Engine behaviour against the model's own dense forward (fp32, CPU)."""

import asyncio
import contextlib
import random
import threading
import time

import pytest
import torch

from astrai.inference import (
    EngineNotReady,
    InferenceEngine,
    RequestRejected,
    SamplingParams,
)

MODES = {
    "contiguous": dict(cache_mode="contiguous"),
    "paged-1": dict(cache_mode="paged", page_size=1, kv_tokens=4096),
    "paged-16-radix": dict(cache_mode="paged", page_size=16, kv_tokens=4096),
}


def prompts(n: int, seed: int = 0, vocab: int = 384) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(rng.randint(3, 60))] for _ in range(n)]


@pytest.mark.parametrize("mode", sorted(MODES))
def test_concurrent_greedy_equals_full_recomputation(model, tokenizer, mode, greedy_reference):
    ps = prompts(16)
    with InferenceEngine(
        model, tokenizer, max_batch_size=16, max_seq_len=128, **MODES[mode]
    ) as eng:
        results = [eng.submit(p, max_tokens=12, temperature=0.0, ignore_eos=True) for p in ps]
        for r in results:
            r.wait_completion(timeout=120)
    for p, r in zip(ps, results):
        assert r.token_ids == greedy_reference(model, p, 12)
        assert r.finish_reason == "length"


def test_chunked_prefill_gives_the_same_tokens(model, tokenizer, greedy_reference):
    ps = prompts(6, seed=1)
    with InferenceEngine(model, tokenizer, max_batch_size=6, max_prefill_tokens=7) as eng:
        out = eng.run_batch(ps, max_tokens=6, temperature=0.0, ignore_eos=True)
    assert out == [greedy_reference(model, p, 6) for p in ps]


def test_run_batch_logprobs_equal_training_forward(model, tokenizer):
    ps = prompts(5, seed=2)
    with InferenceEngine(model, tokenizer, start=False, cache_mode="paged", page_size=4) as eng:
        out = eng.run_batch(
            ps, max_tokens=8, temperature=1.0, seed=7, return_logprobs=True, ignore_eos=True
        )
    for p, (ids, lps) in zip(ps, out):
        assert len(ids) == len(lps) == 8
        full = torch.tensor([p + ids])
        with torch.no_grad():
            logp = torch.log_softmax(model(full)[0].float(), -1)
        ref = logp[len(p) - 1 : -1].gather(-1, torch.tensor(ids)[:, None])[:, 0]
        torch.testing.assert_close(torch.tensor(lps), ref, atol=1e-5, rtol=0)


def test_prefix_cache_reuse_and_invalidation(model, tokenizer, greedy_reference):
    rng = random.Random(3)
    shared = [rng.randrange(384) for _ in range(100)]
    a, b = [*shared, 1, 2, 3], [*shared, 7, 8, 9, 10]
    kw = dict(max_tokens=5, temperature=0.0, ignore_eos=True, return_details=True)
    with InferenceEngine(model, tokenizer, cache_mode="paged", page_size=16, start=False) as eng:
        eng.run_batch([a], **kw)
        before = eng.get_stats()["cached_prompt_tokens"]
        (res,) = eng.run_batch([b], **kw)
        reused = eng.get_stats()["cached_prompt_tokens"] - before
        assert reused == 96  # six complete pages of the shared prefix
        assert res.token_ids == greedy_reference(model, b, 5)
        eng.update_weights(lambda: None)  # version bump: nothing built by old weights is reused
        assert eng.policy_version == 1
        before = eng.get_stats()["cached_prompt_tokens"]
        eng.run_batch([b], **kw)
        assert eng.get_stats()["cached_prompt_tokens"] == before


def test_rejections_name_the_problem_and_do_not_block_others(model, tokenizer):
    good = prompts(2, seed=4)
    with InferenceEngine(model, tokenizer, max_seq_len=64, start=False) as eng:
        out = eng.run_batch(
            [good[0], [], list(range(64)), good[1]],
            max_tokens=3,
            return_details=True,
            temperature=0.0,
            ignore_eos=True,
        )
        reasons = [r.finish_reason for r in out]
        assert reasons == ["length", "rejected", "rejected", "length"]
        assert "empty" in out[1].error and "too long" in out[2].error
        (bad,) = eng.run_batch([good[0]], max_tokens=0, return_details=True)
        assert bad.finish_reason == "rejected" and "max_tokens" in bad.error
        with pytest.raises(ValueError, match="top_p"):
            eng.run_batch([good[0]], top_p=1.5)
        with pytest.raises(ValueError, match="temperature"):
            eng.submit("hello", temperature=-1.0)
    with InferenceEngine(model, tokenizer, max_seq_len=64) as eng:
        with pytest.raises(ValueError, match="empty prompt"):
            eng.generate("", max_tokens=2)
        assert eng.generate("def f", max_tokens=3, temperature=0.0, ignore_eos=True)


def test_generate_api_forms(model, tokenizer):
    with InferenceEngine(model, tokenizer, max_batch_size=4) as eng:
        kw = dict(max_tokens=6, temperature=0.0, ignore_eos=True)
        single = eng.generate("import os", **kw)
        assert isinstance(single, str)
        assert "".join(eng.generate("import os", stream=True, **kw)) == single
        many = eng.generate(["import os", "class A:"], **kw)
        assert many[0] == single and isinstance(many[1], str)
        pieces = {0: "", 1: ""}
        for i, text in eng.generate(["import os", "class A:"], stream=True, **kw):
            pieces[i] += text
        assert [pieces[0], pieces[1]] == many

        async def collect():
            return "".join([t async for t in eng.generate_async("import os", **kw)])

        assert asyncio.run(collect()) == single
        stats = eng.get_stats()
        assert {"total_tasks", "total_tokens", "active_tasks", "waiting_queue"} <= set(stats)


def test_seeded_sampling_is_reproducible(model, tokenizer):
    with InferenceEngine(model, tokenizer) as eng:
        a = eng.generate("x = ", max_tokens=10, temperature=1.0, seed=123, ignore_eos=True)
        b = eng.generate("x = ", max_tokens=10, temperature=1.0, seed=123, ignore_eos=True)
    assert a == b
    with InferenceEngine(model, tokenizer) as eng:  # any int seed, however large
        assert eng.generate("x = ", max_tokens=3, seed=2**70, ignore_eos=True) and eng.ready


@pytest.mark.slow
def test_random_stress_frees_everything_and_ends_each_stream_once(model, tokenizer):
    rng = random.Random(5)
    ends: dict[int, int] = {}
    lock = threading.Lock()

    def on_end(result):
        with lock:
            ends[result.id] = ends.get(result.id, 0) + 1

    with InferenceEngine(
        model,
        tokenizer,
        cache_mode="paged",
        page_size=4,
        kv_tokens=256,
        max_batch_size=8,
        max_seq_len=96,
    ) as eng:
        results = []
        for i in range(300):
            n = rng.randint(0, 70)
            prompt = [rng.randrange(4) for _ in range(n)]  # few symbols: many shared prefixes
            r = eng.submit(
                prompt, max_tokens=rng.randint(1, 20), temperature=1.0, seed=i, ignore_eos=True
            )
            r.subscribe(lambda text: None, on_end)
            results.append(r)
            if rng.random() < 0.2:
                eng.cancel(rng.choice(results))
        for r in results:
            with contextlib.suppress(ValueError):  # rejected: empty prompt
                r.wait_completion(timeout=300)
        reasons = {r.finish_reason for r in results}
        eng.stop()
        assert eng.pool.all_free()
    assert all(r.done for r in results)
    assert sorted(ends) == sorted(r.id for r in results) and set(ends.values()) == {1}
    assert reasons <= {"length", "cancelled", "rejected", "aborted"} and "length" in reasons


def test_loop_crash_ends_every_stream_and_frees_kv(model, tokenizer):
    # A fault of the scheduler itself (not of one request, not of the model forward: those
    # are contained, see test_fault_isolation.py) ends the loop.
    eng = InferenceEngine(model, tokenizer, cache_mode="paged", page_size=4, start=False)
    original = eng.scheduler.postprocess
    calls = {"n": 0}

    def flaky(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("boom")
        return original(*args, **kwargs)

    eng.scheduler.postprocess = flaky
    try:
        results = [eng.submit(p, max_tokens=20, ignore_eos=True) for p in prompts(4, seed=6)]
        eng.start()
        for r in results:
            with pytest.raises(ValueError, match="boom"):
                r.wait_completion(timeout=60)
        assert not eng.ready and eng.pool.all_free()
        assert {r.finish_reason for r in results} == {"aborted"}
    finally:
        del eng.scheduler.postprocess
        eng.shutdown()


def test_cancel_waiting_and_running(model, tokenizer):
    with InferenceEngine(model, tokenizer, max_batch_size=1, start=False) as eng:
        a = eng.submit([1, 2, 3], max_tokens=50, ignore_eos=True)
        b = eng.submit([4, 5], max_tokens=50, ignore_eos=True)
        eng.step()  # a runs, b waits (one batch slot)
        assert a.task.row is not None and b.task.row is None
        assert eng.cancel(b) and eng.cancel(a.id)
        eng.step()
        assert a.finish_reason == b.finish_reason == "cancelled"
        assert not eng.cancel(a)
        assert eng.pool.all_free() and not eng.scheduler.has_work()


def test_shutdown_cancels_what_is_open(model, tokenizer):
    eng = InferenceEngine(model, tokenizer, max_batch_size=1, start=False)
    results = [eng.submit([1, 2, 3], max_tokens=50, ignore_eos=True) for _ in range(2)]
    eng.step()
    eng.shutdown()
    assert [r.finish_reason for r in results] == ["cancelled", "cancelled"]
    assert eng.pool.all_free() and not eng.ready
    with pytest.raises(EngineNotReady):
        eng.submit("x")


def _wait(cond, timeout: float = 60.0) -> bool:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def test_closing_a_stream_early_cancels_its_request(model, tokenizer):
    kw = dict(max_tokens=400, temperature=1.0, ignore_eos=True)
    with InferenceEngine(model, tokenizer) as eng:

        def settled():
            s = eng.get_stats()
            return s["active_tasks"] == 0 and s["waiting_queue"] == 0

        stream = eng.generate("import os", stream=True, **kw)
        next(stream)
        stream.close()
        assert _wait(settled)
        first = eng.get_stats()["total_tokens"]
        assert first < 100  # not run on to max_tokens
        for _ in eng.generate("import os", stream=True, **kw):
            break  # the stream is dropped here
        pairs = eng.generate(["import os", "class A:"], stream=True, **kw)
        next(pairs)
        pairs.close()
        assert _wait(settled)
        assert eng.get_stats()["total_tokens"] - first < 300
        assert eng.pool.all_free()


def test_subscribe_delivers_earlier_text_then_the_rest_once(model, tokenizer):
    kw = dict(max_tokens=40, temperature=1.0, seed=0, ignore_eos=True)
    with InferenceEngine(model, tokenizer, start=False) as eng:
        r = eng.submit("import os", **kw)
        while not r.text and not r.done:
            eng.step()  # some text exists before anyone subscribes
        assert r.text and not r.done
        assert r.wait(timeout=0) and not r.wait(timeout=0)  # the event: new text, then none
        early, ends = [], []
        r.subscribe(early.append, ends.append)
        while eng.scheduler.has_work():
            eng.step()
        late, late_ends = [], []
        r.subscribe(late.append, late_ends.append)  # after the end: everything at once
    assert "".join(early) == "".join(late) == r.text
    assert ends == late_ends == [r]


def test_check_request_is_the_one_check(model, tokenizer):
    with InferenceEngine(model, tokenizer, max_seq_len=64, start=False) as eng:
        ok = SamplingParams(max_tokens=4)
        eng.check_request([1, 2, 3], ok)
        cases = [
            ([1, 2], SamplingParams(top_p=1.5), "^top_p"),
            ([1, 2], SamplingParams(max_tokens="4"), "^max_tokens must be an int"),
            ([1, 2], SamplingParams(logit_bias={384: 1.0}), "^logit_bias token id 384"),
            ([], ok, "empty prompt"),
            (list(range(64)), ok, "prompt is too long: 64 tokens, the limit is 63"),
            ([1, 2], SamplingParams(max_tokens=0), "^max_tokens must be positive"),
            ([1, 384], ok, "outside the vocabulary"),
        ]
        for ids, params, match in cases:
            with pytest.raises(ValueError, match=match):
                eng.check_request(ids, params)
        # submit: bad settings raise at once (a vocabulary-checked logit_bias included);
        # a prompt that can never run ends as `rejected`, naming the same reason.
        with pytest.raises(ValueError, match="logit_bias token id 384"):
            eng.submit([1, 2], logit_bias={384: 1.0})
        r = eng.submit([1, 384], max_tokens=2)
        assert r.finish_reason == "rejected" and "outside the vocabulary" in r.task.error
        with pytest.raises(RequestRejected, match="empty prompt"):  # a ValueError subclass
            eng.check_request([], ok)
        # run_batch: every prompt is checked before anything runs; bad settings raise
        with pytest.raises(ValueError, match=r"^top_p"):
            eng.run_batch([[1, 2], [3]], top_p=1.5)
        assert (
            not eng.scheduler.has_work() and eng.get_stats()["total_tasks"] == 1
        )  # the rejected one
        assert eng.vocab_size == 384 and eng.max_seq_len == 64
        assert not eng.queue_full


def test_max_tokens_beyond_the_context_follows_its_policy(model, tokenizer):
    """`max_tokens_policy="error"`: prompt + max_tokens beyond the context is rejected by the
    engine's one check, naming both numbers and `max_tokens`; "clamp" (the default, what
    rollouts rely on) generates until the context is full."""
    with InferenceEngine(model, tokenizer, max_seq_len=32, start=False) as eng:
        strict = SamplingParams(max_tokens=23, max_tokens_policy="error", ignore_eos=True)
        with pytest.raises(RequestRejected) as info:
            eng.check_request(list(range(10)), strict)  # 10 + 23 = 33 > 32
        assert info.value.param == "max_tokens"
        assert "maximum context length is 32 tokens" in str(info.value)
        assert "33 were requested" in str(info.value) and "at most 22" in str(info.value)
        eng.check_request(list(range(9)), strict)  # 9 + 23 = 32: fits exactly
        with pytest.raises(RequestRejected, match="prompt is too long") as info:  # the prompt's
            eng.check_request(list(range(32)), strict)
        assert info.value.param == "prompt"
        r = eng.submit(list(range(10)), strict)
        assert r.finish_reason == "rejected" and r.task.error_param == "max_tokens"
        with pytest.raises(ValueError, match="max_tokens_policy must be one of clamp, error"):
            eng.check_request([1, 2], SamplingParams(max_tokens_policy="truncate"))
        clamped = eng.submit(list(range(10)), max_tokens=1000, ignore_eos=True, temperature=0.0)
        while eng.scheduler.has_work():
            eng.step()
        assert clamped.finish_reason == "length" and len(clamped.token_ids) == 22
        [batch] = eng.run_batch(
            [list(range(10))], max_tokens=1000, ignore_eos=True, return_details=True
        )
        assert batch.finish_reason == "length" and len(batch.token_ids) == 22


def test_settings_travel_in_sampling_params(model, tokenizer, greedy_reference):
    prompt = [5, 9, 2, 7]
    first, second = greedy_reference(model, prompt, 2)
    with InferenceEngine(model, tokenizer, start=False) as eng:
        base = SamplingParams(temperature=0.0, max_tokens=5, stop_ids=[second])
        assert base.stop_ids == frozenset({second})
        stopped = eng.submit(prompt, base)
        ignored = eng.submit(prompt, base, ignore_eos=True)  # keywords override params
        short = eng.submit(prompt, base, max_tokens=1)
        while eng.scheduler.has_work():
            eng.step()
    assert stopped.token_ids == [first, second] and stopped.finish_reason == "stop"
    assert len(ignored.token_ids) == 5 and ignored.finish_reason == "length"
    assert short.token_ids == [first] and short.finish_reason == "length"


def test_weight_versions_only_advance_and_only_when_idle(model, tokenizer):
    with InferenceEngine(model, tokenizer, start=False) as eng:
        calls = []
        assert eng.update_weights(lambda: calls.append(1), version=3) == 3 and calls == [1]
        with pytest.raises(ValueError, match="older"):
            eng.update_weights(version=2)
        with pytest.raises(ValueError, match="greater than"):
            eng.update_weights(version=3)  # new weights are a new policy
        with pytest.raises(ValueError, match="non-negative"):
            eng.update_weights(version=-1)
        with pytest.raises(ValueError, match="version"):
            eng.update_weights(version=True)
        assert calls == [1] and eng.policy_version == 3  # nothing ran for a refused version
        assert eng.update_weights() == 4 and eng.policy_version == 4
        eng.submit([1, 2], max_tokens=2)
        with pytest.raises(RuntimeError, match="queued"):
            eng.update_weights(version=5)
    with InferenceEngine(model, tokenizer) as eng:  # a running loop is paused and resumed
        assert eng.generate("x", max_tokens=2, seed=0, ignore_eos=True)  # not two stop ids
        assert eng.update_weights(version=7) == 7 and eng.ready


def test_backend_chosen_by_the_submitting_thread_is_strict_and_isolated(
    model, tokenizer, monkeypatch
):
    from astrai.extension import attn_backend

    monkeypatch.setenv("TRITON_INTERPRET", "0")  # CPU tensors: triton cannot serve them

    with InferenceEngine(model, tokenizer) as eng:
        with attn_backend("triton"):  # not servable on CPU: that request fails, loudly
            doomed = eng.submit("import os", max_tokens=3)
        with pytest.raises(ValueError, match="triton"):
            doomed.wait_completion(timeout=60)
        with attn_backend("torch_native"):
            ok = eng.submit("import os", max_tokens=3, temperature=0.0, ignore_eos=True)
        assert len(ok.wait_completion(timeout=60)) > 0 and ok.finish_reason == "length"
        assert eng.ready


@pytest.mark.parametrize("mode", ["contiguous", "paged"])
def test_rows_of_one_admission_follow_prompt_length(model, tokenizer, mode):
    """Contiguous rows taken together are handed out shortest prompt first (neighbouring
    rows then have similar lengths, which the CPU decode attention pads less); paged rows
    keep their arrival order. Outputs are checked elsewhere; here the placement."""
    lengths = [40, 5, 23, 9, 31]
    with InferenceEngine(
        model, tokenizer, max_batch_size=8, max_seq_len=64, start=False, cache_mode=mode
    ) as eng:
        results = [
            eng.submit([7] * n, max_tokens=2, temperature=0.0, ignore_eos=True) for n in lengths
        ]
        eng.scheduler.schedule()  # one admission, as the loop's next step would do
        rows = [r.task.row for r in results]
        assert sorted(rows) == list(range(len(lengths)))
        by_row = [n for _, n in sorted(zip(rows, lengths))]
        assert by_row == (sorted(lengths) if mode == "contiguous" else lengths)
        while eng.scheduler.has_work():  # the admitted tasks then run to completion as usual
            eng.step()
    assert all(len(r.token_ids) == 2 and r.finish_reason == "length" for r in results)
