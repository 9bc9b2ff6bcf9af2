"""GRPO's rollout sources (astrai.train.strategies.grpo.source and its implementations):
recording wraps a source, a replay hands back the ledger's samples by seed, options are
checked in one place, and the module holds one source, chosen once."""

from __future__ import annotations

from typing import Any

import pytest

from astrai.train.strategies.grpo.options import GRPOOptions
from astrai.train.strategies.grpo.replay_source import ReplaySource
from astrai.train.strategies.grpo.sampling import Samples
from astrai.train.strategies.grpo.source import RecordingSource, RolloutSource


def _samples(seed: int) -> Samples:
    return Samples(
        prompts=[[1, 2]] * 2,
        completions=[[3], [4, 5]],
        logprobs=[[-0.5], [-0.1, -0.2]],
        truncated=[False, True],
        rewards=[1.0, 0.0],
        version=seed,
    )


class Canned(RolloutSource):
    def __init__(self) -> None:
        self.taken: list[tuple[int, int]] = []
        self.loaded: Any = None
        self.closed = False

    def take(self, batch, seed, step):
        self.taken.append((seed, step))
        self.waited = 0.25
        return _samples(seed)

    def state_dict(self):
        return {"grpo_pending": ["x"]}

    def load_state_dict(self, state):
        self.loaded = dict(state)

    def close(self):
        self.closed = True


def test_recording_hands_every_take_to_the_ledger_and_delegates_the_rest():
    inner, heard = Canned(), []
    source = RecordingSource(inner, lambda seed, s: heard.append((seed, s.completions)))
    got = source.take({"prompt_ids": [[1, 2]], "records": [{}]}, 7, 3)
    assert got.version == 7 and inner.taken == [(7, 3)]
    assert heard == [(7, [[3], [4, 5]])] and source.waited == 0.25
    assert source.state_dict() == {"grpo_pending": ["x"]}
    source.load_state_dict({"grpo_pending": []})
    assert inner.loaded == {"grpo_pending": []}
    source.close()
    assert inner.closed


def test_replay_returns_the_recorded_samples_by_seed_and_keeps_the_replaced_source():
    replaced = Canned()
    records = {5: {**_samples(5).state_dict(), "seed": 5, "step": 2}}  # ledger rows carry more
    source = ReplaySource(records.__getitem__, replaced)
    got = source.take({"prompt_ids": [[9]], "records": [{}]}, 5, 2)
    assert got == _samples(5) and replaced.taken == []  # nothing sampled
    with pytest.raises(KeyError):
        source.take({}, 6, 2)
    assert source.state_dict() == {"grpo_pending": ["x"]}
    source.close()
    assert replaced.closed


def test_options_are_checked_and_resolved_in_one_place():
    o = GRPOOptions.parse(num_generations=4, epsilon=0.2, rewards=["exact_match"])
    assert o.epsilon_high == 0.2 and o.scale_rewards == "group"
    assert o.sampling.n == 4 and o.sampling.logprobs_mode == "scaled"
    assert o.val_sampling.temperature == 0.0 and o.val_max_new_tokens == o.max_new_tokens
    assert o.async_rollouts is None and o.environment is None
    mine, rest = GRPOOptions.split({"num_generations": 4, "model": "m", "lora": None})
    assert mine == {"num_generations": 4} and rest == {"model": "m", "lora": None}
    for bad, message in (
        ({"num_generations": 1}, "num_generations must be >= 2"),
        ({"num_iterations": 0}, "num_iterations must be an int >= 1"),
        ({"temperature": 0.0}, "temperature must be > 0"),
        ({"async_rollouts": {"max_staleness": -1}}, "max_staleness"),
    ):
        with pytest.raises(ValueError, match=message):
            GRPOOptions.parse(**bad)
