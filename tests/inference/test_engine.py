"""Engine behaviour against the model's own dense forward (fp32, CPU)."""

import asyncio
import random
import threading

import pytest
import torch

from astrai.inference import InferenceEngine, InferenceScheduler, Task
from astrai.inference.cache import PagePool

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
        assert eng.scheduler.policy_version == 1
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
            r.finish_callbacks.append(on_end)
            if r.done:
                on_end(r)
            results.append(r)
            if rng.random() < 0.2:
                eng.cancel(rng.choice(results))
        for r in results:
            r._cond.acquire()
            r._cond.wait_for(lambda r=r: r.done, timeout=300)
            r._cond.release()
        reasons = {r.finish_reason for r in results}
        eng.scheduler.stop()
        assert eng.pool.all_free()
    assert all(r.done for r in results)
    assert sorted(ends) == sorted(r.id for r in results) and set(ends.values()) == {1}
    assert reasons <= {"length", "cancelled", "rejected", "aborted"} and "length" in reasons


def test_loop_crash_ends_every_stream_and_frees_kv(model, tokenizer):
    eng = InferenceEngine(model, tokenizer, cache_mode="paged", page_size=4, start=False)
    original = eng.model.forward_packed
    calls = {"n": 0}

    def flaky(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("boom")
        return original(*args, **kwargs)

    eng.model.forward_packed = flaky
    try:
        results = [eng.submit(p, max_tokens=20, ignore_eos=True) for p in prompts(4, seed=6)]
        eng.scheduler.start()
        for r in results:
            with pytest.raises(ValueError, match="boom"):
                r.wait_completion(timeout=60)
        assert not eng.ready and eng.pool.all_free()
        assert {r.finish_reason for r in results} == {"aborted"}
    finally:
        del eng.model.forward_packed
        eng.shutdown()


def test_cancel_waiting_and_running(model, tokenizer):
    pool = PagePool(num_layers=2, num_kv_heads=2, head_dim=16, max_batch_size=1, max_seq_len=128)
    sched = InferenceScheduler(model, pool, max_batch_size=1)
    a = sched.submit(Task(prompt_ids=[1, 2, 3], max_tokens=50, ignore_eos=True))
    b = sched.submit(Task(prompt_ids=[4, 5], max_tokens=50, ignore_eos=True))
    sched._iteration()  # a runs, b waits (one batch slot)
    assert sched.cancel_task(b.id) and sched.cancel_task(a.id)
    sched._iteration()
    assert a.finish_reason == b.finish_reason == "cancelled"
    assert not sched.cancel_task(a.id)
    assert pool.all_free()


def test_weight_updates_only_when_idle(model, tokenizer):
    with InferenceEngine(model, tokenizer, start=False) as eng:
        sched = eng.scheduler
        sched.update_weights(3)
        with pytest.raises(ValueError, match="older"):
            sched.update_weights(2)
        with pytest.raises(ValueError, match="non-negative"):
            sched.update_weights(-1)
        sched.submit(Task(prompt_ids=[1, 2], max_tokens=2))
        with pytest.raises(RuntimeError, match="queued"):
            sched.update_weights(4)


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
        eng.scheduler._refill()  # one admission, as the loop's next iteration would do
        rows = [r.task.row for r in results]
        assert sorted(rows) == list(range(len(lengths)))
        by_row = [n for _, n in sorted(zip(rows, lengths))]
        assert by_row == (sorted(lengths) if mode == "contiguous" else lengths)
        eng.scheduler._iteration()  # the admitted tasks then run to completion as usual
        while eng.scheduler.has_work():
            eng.scheduler._iteration()
    assert all(len(r.token_ids) == 2 and r.finish_reason == "length" for r in results)
