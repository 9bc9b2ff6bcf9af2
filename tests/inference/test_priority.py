"""vLLM's `scheduling_policy="priority"` (`astrai.inference.priority`): the waiting queue in
(priority, arrival) order, lower first, and the least urgent running request preempted when
the KV pool runs short; "fcfs" refuses a non-zero priority, as vLLM. Every request still
ends with its full output: the dense forward's greedy tokens (`greedy_reference`)."""

import random

import pytest

from astrai.inference import InferenceEngine, SamplingParams
from astrai.inference.engine_options import check_engine_blocks

MAX_TOKENS = 8


def _prompts(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(384) for _ in range(rng.randint(6, 12))] for _ in range(n)]


def _finish_order(eng: InferenceEngine, prompts, priorities, max_tokens=MAX_TOKENS):
    """Submit everything on a stopped engine, then start it; (finish order, token ids)."""
    order: list[int] = []
    results = []
    for i, (p, prio) in enumerate(zip(prompts, priorities)):
        r = eng.submit(p, max_tokens=max_tokens, temperature=0.0, ignore_eos=True, priority=prio)
        inner = r.task.on_finish

        def on_finish(task, i=i, inner=inner):
            order.append(i)
            inner(task)

        r.task.on_finish = on_finish
        results.append(r)
    eng.start()
    for r in results:
        r.wait_completion(timeout=120)
    eng.stop()
    assert [r.finish_reason for r in results] == ["length"] * len(prompts)
    return order, [r.token_ids for r in results]


@pytest.mark.parametrize("cache_mode", ["contiguous", "paged"])
def test_one_row_serves_the_queue_in_priority_then_arrival_order(
    model, tokenizer, cache_mode, greedy_reference
):
    prompts = _prompts(8, seed=3)
    priorities = [5, 5, 2, 7, 2, -1, 5, 0]
    with InferenceEngine(
        model,
        tokenizer,
        max_batch_size=1,
        max_seq_len=64,
        cache_mode=cache_mode,
        scheduling_policy="priority",
        start=False,
    ) as eng:
        order, ids = _finish_order(eng, prompts, priorities)
    assert order == sorted(range(8), key=lambda i: (priorities[i], i))
    assert ids == [greedy_reference(model, p, MAX_TOKENS) for p in prompts]


@pytest.mark.parametrize("policy", ["priority", "fcfs"])
def test_urgent_requests_overtake_a_full_queue(model, tokenizer, policy, greedy_reference):
    """Six requests wait before two urgent ones, three rows: under "priority" the urgent two
    finish first; under "fcfs" (every priority 0) they finish last, as they arrived."""
    prompts = _prompts(8, seed=4)
    urgent = policy == "priority"
    priorities = [10] * 6 + [0] * 2 if urgent else [0] * 8
    with InferenceEngine(
        model,
        tokenizer,
        max_batch_size=3,
        max_seq_len=64,
        scheduling_policy=policy,
        start=False,
    ) as eng:
        order, ids = _finish_order(eng, prompts, priorities)
    late = set(order[:2]) if urgent else set(order[-2:])
    assert late == {6, 7}
    assert ids == [greedy_reference(model, p, MAX_TOKENS) for p in prompts]


@pytest.mark.parametrize("policy", ["priority", "fcfs"])
def test_kv_pressure_preempts_the_least_urgent(model, tokenizer, policy, greedy_reference):
    """A (priority 1) runs alone for a few steps; then B (priority 0) is admitted beside it,
    and the pool (100 tokens) cannot hold both at 20 + 40. Under "priority" the older but
    less urgent A yields; under "fcfs" the newest, B. Both end with their full output."""
    rng = random.Random(11)
    a, b = ([rng.randrange(384) for _ in range(20)] for _ in range(2))
    urgent = policy == "priority"
    with InferenceEngine(
        model,
        tokenizer,
        max_batch_size=4,
        max_seq_len=128,
        cache_mode="paged",
        page_size=1,
        kv_tokens=100,
        scheduling_policy=policy,
        start=False,
    ) as eng:
        params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
        ra = eng.submit(a, params, priority=1 if urgent else 0)
        for _ in range(5):
            eng.step()
        rb = eng.submit(b, params)
        while not (ra.done and rb.done):
            eng.step()
        assert eng.get_stats()["preemptions"] > 0
        assert eng.pool.all_free()
    preempted = {"A": ra.task.preemptions > 0, "B": rb.task.preemptions > 0}
    assert preempted == ({"A": True, "B": False} if urgent else {"A": False, "B": True})
    assert [ra.finish_reason, rb.finish_reason] == ["length", "length"]
    assert ra.token_ids == greedy_reference(model, a, 40)
    assert rb.token_ids == greedy_reference(model, b, 40)


def test_fcfs_refuses_a_non_zero_priority_as_vllm(model, tokenizer):
    with InferenceEngine(model, tokenizer, max_batch_size=2, max_seq_len=64, start=False) as eng:
        with pytest.raises(ValueError, match=r"^priority 3 needs scheduling_policy=priority"):
            eng.submit([1, 2, 3], max_tokens=2, priority=3)
        assert eng.get_stats()["waiting_queue"] == 0  # refused before anything was queued
        eng.submit([1, 2, 3], max_tokens=2, priority=0)  # the default is accepted


@pytest.mark.parametrize("bad", [1.5, "1", True, None])
def test_priority_must_be_an_int(bad):
    with pytest.raises(ValueError, match=r"^priority must be an int"):
        SamplingParams(priority=bad).validate()


def test_an_unknown_policy_names_the_option(model, tokenizer):
    with pytest.raises(ValueError, match=r"^scheduling_policy must be fcfs or priority"):
        InferenceEngine(model, tokenizer, max_seq_len=64, scheduling_policy="lifo", start=False)
    with pytest.raises(SystemExit, match=r"^engine\.scheduling_policy must be"):
        check_engine_blocks({"scheduling_policy": "lifo"})
    assert check_engine_blocks({"scheduling_policy": "priority"}) is None
