"""`RemotePolicy` (GRPO's rollout engine in server mode), with stand-in replicas: a step's
weights are pushed once, as the next version after the highest a replica holds; the pool
then asks for that version, on the replicas that took it; a generation at a step whose
weights another user replaced meanwhile pushes its own again; a push that reached no
replica is tried again and then raised."""

from __future__ import annotations

import pytest
import torch

from astrai.inference import SamplingParams
from astrai.remote.client import RemoteResult, ReplicaUnavailable
from astrai.remote.pool import ReplicaPool
from astrai.train import remote_policy
from astrai.train.remote_policy import RemotePolicy, RolloutChannel

PARAMS = SamplingParams(max_tokens=2, n=2)


class Client:
    def __init__(self, url: str, version: int) -> None:
        self.url, self.version = url, version
        self.asked: list[int | None] = []

    def policy_version(self) -> int:
        return self.version

    def generate(self, input_ids, params, *, seed, policy_version=None):
        self.asked.append(policy_version)
        return [RemoteResult([1], [0.0], "length") for _ in range(params.n)]

    def close(self) -> None:
        return None


class Sender:
    """Records each push (version, the first tensor's value); `fail` pushes raise."""

    def __init__(self, clients, alive) -> None:
        self.clients, self.alive = clients, alive
        self.pushes: list[tuple[int, float]] = []
        self.fail = 0

    def push(self, named, version):
        if self.fail:
            self.fail -= 1
            raise ReplicaUnavailable("no replica reachable")
        named = list(named)
        self.pushes.append((version, float(named[0][1])))
        for c in self.alive:
            c.version = version
        return 0.01

    def close(self) -> None:
        return None


def _policy(weights: dict[int, float], channel: RolloutChannel) -> RemotePolicy:
    return RemotePolicy(
        channel, lambda: (None, None), lambda step: [("w", torch.tensor(weights[step]))]
    )


@pytest.fixture
def replicas():
    a, b = Client("http://a", 7), Client("http://b", 3)
    pool = ReplicaPool([a, b], max_seq_len=32)
    sender = Sender([a, b], alive=[b])  # a missed the group
    yield a, b, RolloutChannel(pool, sender)
    pool.close()


def test_a_step_is_pushed_once_as_the_next_version(replicas):
    a, b, channel = replicas
    policy = _policy({0: 10.0, 1: 11.0}, channel)
    at = policy.sync(0)
    assert channel.sender.pushes == [(8, 10.0)]  # after the highest a replica holds (7)
    assert policy.sync(0).step == 0 and channel.sender.pushes == [(8, 10.0)]
    assert len(at.run_batch([[1, 2], [3]], PARAMS, seed=0)) == 4
    assert b.asked == [8, 8] and a.asked == [], "only the replica that took the weights"
    assert at.policy_version == 0 and at.max_seq_len == 32
    policy.sync(1)
    assert channel.sender.pushes == [(8, 10.0), (9, 11.0)]


def test_a_generation_pushes_its_weights_again_after_another_user(replicas):
    _, b, channel = replicas
    generator = _policy({0: 10.0}, channel)
    trainer = _policy({1: 11.0}, channel)  # e.g. validation on the live weights
    at = generator.sync(0)
    trainer.sync(1)
    at.run_batch([[1]], PARAMS, seed=0)
    assert channel.sender.pushes == [(8, 10.0), (9, 11.0), (10, 10.0)]
    assert b.asked == [10]


def test_load_runs_before_the_push(replicas):
    _, _, channel = replicas
    state = {0: 1.0}
    policy = _policy(state, channel)
    policy.sync(0, load=lambda: state.update({0: 5.0}))
    assert channel.sender.pushes == [(8, 5.0)]


def test_a_push_that_reached_no_replica_is_tried_again(replicas, monkeypatch):
    _, _, channel = replicas
    monkeypatch.setattr(remote_policy, "PUSH_PAUSE_S", 0.0)
    policy = _policy({0: 1.0, 1: 2.0}, channel)
    channel.sender.fail = remote_policy.PUSH_TRIES - 1
    policy.sync(0)
    assert channel.sender.pushes == [(8, 1.0)]
    channel.sender.fail = remote_policy.PUSH_TRIES
    with pytest.raises(ReplicaUnavailable, match="no replica reachable"):
        policy.sync(1)
    assert channel.holds() == 0, "a failed push leaves the replicas' step as it was"


def test_on_group_reports_each_prompts_results_once_they_arrive(replicas):
    _, _, channel = replicas
    at = _policy({0: 10.0}, channel).sync(0)
    groups: dict[int, list] = {}
    results = at.run_batch([[1, 2], [3]], PARAMS, seed=0, on_group=groups.__setitem__)
    assert sorted(groups) == [0, 1]
    assert groups[0] + groups[1] == results and len(groups[0]) == PARAMS.n
