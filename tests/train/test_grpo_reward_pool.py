"""Concurrent rewards (astrai/train/strategies/grpo/reward_pool.py): synchronous rewards on a
bounded thread pool, async ones on the daemon event loop, each group scored as soon as the
engine finishes it; failures (raise, non-finite, timeout) give the failure value and a count.
Timing is compared against a serial run measured in the same test, never a fixed threshold."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
import torch
from grpo_helpers import FakeResult, make_grpo, prompt_data

from astrai.inference import InferenceEngine, SamplingParams
from astrai.model import preset_model
from astrai.train.strategies.grpo.reward_pool import RewardPool
from astrai.train.strategies.grpo.rewards import WeightedReward
from astrai.train.strategies.grpo.sampling import engine_generate, sample_turns

SLEEP = 0.5


def slow_length(record, completion):
    time.sleep(SLEEP)
    return float(len(completion) % 3)


async def async_slow_length(record, completion):
    await asyncio.sleep(SLEEP)
    return float(len(completion) % 3)


def boom(record, completion):
    if completion.startswith("b"):
        raise ValueError("no b")
    return 1.0


def hangs(record, completion):
    time.sleep(3.0)
    return 1.0


async def async_hangs(record, completion):
    await asyncio.sleep(30.0)
    return 1.0


def not_finite(record, completion):
    return float("inf")


class AsyncBatchReward:
    """A class whose ``batch`` is async: one call per group."""

    def __init__(self):
        self.calls = 0

    def __call__(self, record, completion):
        raise AssertionError("the batch method scores")

    async def batch(self, records, completions):
        self.calls += 1
        await asyncio.sleep(0.01)
        return [float(len(c)) for c in completions]


def entry(fn, **kw):
    return {"_target_": f"{__name__}.{fn}", "_partial_": True, **kw}


class Tok:
    """Ids are characters' codes; decode joins them back."""

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(i) for i in ids)


TEXTS = ["a", "bb", "ccc", "dddd", "bee", "ff", "g", "hhhhh"]
PROMPTS = [[1, 2], [3, 4]]


def canned(prompts, *, seed, params):
    return [FakeResult([ord(ch) for ch in t], [0.0] * len(t)) for t in TEXTS]


def run(rewards, workers):
    pool = rewards if isinstance(rewards, RewardPool) else RewardPool(rewards, workers)
    started = time.perf_counter()
    samples = sample_turns(
        canned,
        Tok(),
        PROMPTS,
        [{"id": 0}, {"id": 1}],
        SamplingParams(max_tokens=8, temperature=1.0, n=4),
        seed=0,
        rewards=pool,
        version=0,
    )
    return samples, time.perf_counter() - started


def serial_scores(fn):
    """The reference: each completion scored after the other (async: awaited in turn)."""
    reward = globals()[fn]
    started = time.perf_counter()
    records = [{"id": i // 4} for i in range(len(TEXTS))]
    if asyncio.iscoroutinefunction(reward):

        async def one_by_one():
            return [await reward(r, t) for r, t in zip(records, TEXTS)]

        values = asyncio.run(one_by_one())
    else:
        values = [reward(r, t) for r, t in zip(records, TEXTS)]
    return values, time.perf_counter() - started


@pytest.mark.parametrize("fn", ["slow_length", "async_slow_length"])
def test_a_slow_reward_costs_under_half_its_serial_time(fn):
    values, serial_s = serial_scores(fn)
    pooled, pooled_s = run([entry(fn)], workers=8)
    assert pooled.rewards == values == [float(len(t) % 3) for t in TEXTS]
    assert pooled_s < serial_s / 2, (pooled_s, serial_s)


def test_one_worker_scores_serially():
    one, one_s = run([entry("slow_length")], workers=1)
    four, four_s = run([entry("slow_length")], workers=4)
    assert one == four
    assert one_s >= len(TEXTS) * SLEEP  # the bound holds: one call at a time
    assert four_s < one_s / 2, (four_s, one_s)


def test_failures_give_the_failure_value_and_are_counted(caplog):
    rewards = [
        entry("boom", failure_value=-1.0),
        entry("hangs", timeout=0.2, failure_value=-2.0),
        entry("async_hangs", timeout=0.2),
        entry("not_finite"),
    ]
    with caplog.at_level("WARNING"):
        samples, _ = run(rewards, workers=8)
    cols = samples.reward_columns
    assert cols["boom"] == [1.0, -1.0, 1.0, 1.0, -1.0, 1.0, 1.0, 1.0]
    assert cols["hangs"] == [-2.0] * 8
    assert cols["async_hangs"] == [0.0] * 8
    assert cols["not_finite"] == [0.0] * 8
    assert samples.stats == {
        "reward/boom/failures": 2.0,
        "reward/hangs/failures": 8.0,
        "reward/async_hangs/failures": 8.0,
        "reward/not_finite/failures": 8.0,
    }
    assert samples.rewards == [sum(c[i] for c in cols.values()) for i in range(8)]
    messages = [r.getMessage() for r in caplog.records]
    for name, why in [("boom", "ValueError: no b"), ("hangs", "timed out"), ("not_finite", "inf")]:
        logged = [m for m in messages if f"reward {name!r} failed" in m]
        assert len(logged) == 1 and why in logged[0], (name, messages)


def test_an_async_batch_reward_is_called_once_per_group():
    reward = AsyncBatchReward()
    pool = RewardPool([WeightedReward("lengths", 1.0, reward)], 8)
    samples, _ = run(pool, workers=8)
    assert reward.calls == 2  # one batch per group of 4
    assert samples.reward_columns["lengths"] == [float(len(t)) for t in TEXTS]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root, tok = prompt_data(tmp_path_factory.mktemp("pool"))
    torch.manual_seed(0)
    model = preset_model("tiny", vocab_size=320).eval()
    # max_batch_size = G: the groups run one after the other, so a group finishes (and is
    # scored) while the next one generates
    engine = InferenceEngine(model, tok, max_batch_size=4, max_seq_len=64)
    yield root, tok, engine
    engine.shutdown()


def test_each_group_is_scored_while_the_engine_generates_the_next(tiny):
    _, tok, engine = tiny
    prompts = [tok.encode(q) for q in ("What is 2 + 3?", "What is 3 * 4?", "What is 7 - 1?")]
    params = SamplingParams(max_tokens=6, temperature=1.0, n=4, logprobs_mode="scaled")
    returned = threading.Event()
    seen_before_return: list[bool] = []

    def watched(record, completion):
        seen_before_return.append(not returned.is_set())
        return float(len(completion))

    def generate(prompts, *, seed, params, on_group=None):
        results = engine_generate(engine, prompts, seed=seed, params=params, on_group=on_group)
        returned.set()
        return results

    pool = RewardPool([WeightedReward("watched", 1.0, watched)], 8)
    kw = dict(seed=5, rewards=pool, version=0)
    records = [{"i": i} for i in range(3)]
    overlapped = sample_turns(generate, tok, prompts, records, params, overlap=True, **kw)
    assert any(seen_before_return)  # scoring started before run_batch returned
    returned.clear()
    serial = sample_turns(generate, tok, prompts, records, params, **kw)
    assert overlapped == serial  # same order, same values (seeded engine)

    groups = {}
    results = engine.run_batch(
        prompts,
        params,
        seed=5,
        return_details=True,
        on_group=lambda i, rs: groups.setdefault(i, [r.token_ids for r in rs]),
    )
    assert sorted(groups) == [0, 1, 2]
    assert [ids for i in range(3) for ids in groups[i]] == [r.token_ids for r in results]


def test_failures_reach_the_generation_metrics(tiny):
    root, tok, _ = tiny
    module = make_grpo(
        root,
        tok,
        rewards=[{"name": "exact_match"}, entry("boom", failure_value=-1.0)],
        reward_workers=2,
    )
    prompts = [tok.encode("What is 2 + 3?"), tok.encode("What is 3 * 4?")]
    texts = ["The answer is 5.", "bad", "5", "x", "12", "b", "1", "2"]

    def fake_generate(prompt_list, *, seed, params):
        return [FakeResult(tok.encode(t), [-1.0] * len(tok.encode(t))) for t in texts]

    module.live_source.generate = fake_generate
    _, metrics = module.compute_loss(
        {"prompt_ids": prompts, "records": [{"answer": "5"}, {"answer": "12"}]}
    )
    assert metrics["reward/boom/failures"].item() == 2.0


def test_reward_workers_is_checked():
    from astrai.train.strategies.grpo import GRPOOptions

    with pytest.raises(ValueError, match="reward_workers"):
        GRPOOptions.parse(reward_workers=0)
    with pytest.raises(ValueError, match=r"strategy.rewards\[0\].timeout"):
        GRPOOptions.parse(rewards=[{"name": "exact_match", "timeout": -1}])
