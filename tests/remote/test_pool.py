"""`ReplicaPool`: prompt groups over replicas equal one engine's `run_batch` bit for bit
(the reference: an in-process batch-invariant engine on the same weights), each group on
one replica, a group whose replica dies (before or while it generates) sent again to
another, refusals raised with the replica's message. The replicas here are stand-ins that
answer from their own batch-invariant engine, as `POST /generate` does."""

from __future__ import annotations

import threading

import pytest
import torch
from tiny_parts import tiny_transformer

from astrai.inference import InferenceEngine, SamplingParams
from astrai.remote.client import (
    RemoteResult,
    ReplicaError,
    ReplicaUnavailable,
    StalePolicyVersion,
)
from astrai.remote.pool import ReplicaPool

N = 4
SEED = 11
PARAMS = SamplingParams(max_tokens=6, temperature=1.0, n=N, logprobs_mode="scaled")
LENGTHS = (3, 9, 1, 17, 5, 12)


@pytest.fixture(scope="module")
def model(stdlib_tokenizer):
    return tiny_transformer(len(stdlib_tokenizer))


def _engine(model, tokenizer) -> InferenceEngine:
    return InferenceEngine(
        model, tokenizer, max_batch_size=32, max_seq_len=64, batch_invariant=True, start=False
    )


def _prompts(vocab: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(5)
    return [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in LENGTHS]


def _rows(results) -> list[tuple[list[int], list[float], str]]:
    return [(list(r.token_ids), list(r.logprobs), r.finish_reason) for r in results]


class Replica:
    """A replica stand-in: `generate` answers from its own engine (one call at a time, as
    one process would), recording each call; `fail` makes it unreachable."""

    def __init__(self, url: str, engine: InferenceEngine, version: int = 0) -> None:
        self.url = url
        self.engine = engine
        self.version = version
        self.calls: list[tuple[list[list[int]], int | None, int | None]] = []
        self.fail: Exception | None = None
        self.lock = threading.Lock()

    def generate(self, input_ids, params, *, seed, policy_version=None):
        self.calls.append(([list(p) for p in input_ids], seed, policy_version))
        if self.fail is not None:
            raise self.fail
        if policy_version is not None and policy_version != self.version:
            raise StalePolicyVersion(
                f"{self.url}/generate: 409: stale_policy_version: asks for {policy_version}, "
                f"holds {self.version}",
                status=409,
                code="stale_policy_version",
            )
        with self.lock:
            out = self.engine.run_batch(input_ids, params, seed=seed, return_details=True)
        return [
            RemoteResult(r.token_ids, r.logprobs, r.finish_reason, r.error, r.cached_prompt_tokens)
            for r in out
        ]

    def close(self) -> None:
        return None


class DiesInFlight(Replica):
    """Takes its first group, waits until the other replica has answered one, then drops
    the connection (a replica killed while a request is in flight)."""

    def __init__(self, url: str, engine: InferenceEngine, other: Replica) -> None:
        super().__init__(url, engine)
        self.other = other

    def generate(self, input_ids, params, *, seed, policy_version=None):
        self.calls.append(([list(p) for p in input_ids], seed, policy_version))
        for _ in range(2000):
            if self.other.calls:
                break
            threading.Event().wait(0.005)
        raise ReplicaUnavailable(f"{self.url}/generate: RemoteProtocolError: peer closed")


@pytest.fixture(scope="module")
def reference(model, stdlib_tokenizer):
    prompts = _prompts(len(stdlib_tokenizer))
    with _engine(model, stdlib_tokenizer) as engine:
        rows = _rows(engine.run_batch(prompts, PARAMS, seed=SEED, return_details=True))
    return prompts, rows


@pytest.fixture
def engines(model, stdlib_tokenizer):
    made = [_engine(model, stdlib_tokenizer) for _ in range(2)]
    yield made
    for e in made:
        e.shutdown()


def test_groups_over_two_replicas_equal_one_engine(engines, reference):
    prompts, expected = reference
    a, b = Replica("http://a", engines[0]), Replica("http://b", engines[1])
    pool = ReplicaPool([a, b], max_seq_len=64)
    try:
        got = _rows(pool.run_batch(prompts, PARAMS, seed=SEED))
    finally:
        pool.close()
    assert got == expected  # token ids, log-probs (float ==) and finish reasons
    calls = a.calls + b.calls
    assert a.calls and b.calls, "both replicas take groups"
    # each group whole on one replica, with run_batch's seed for it
    assert sorted((c[0][0], c[1]) for c in calls) == sorted(
        (p, SEED + i * N) for i, p in enumerate(prompts)
    )
    assert all(len(c[0]) == 1 for c in calls)


def test_unreachable_replica_is_left_out_and_its_groups_go_elsewhere(engines, reference):
    prompts, expected = reference
    a, b = Replica("http://a", engines[0]), Replica("http://b", engines[1])
    a.fail = ReplicaUnavailable("http://a/generate: ConnectError: refused")
    pool = ReplicaPool([a, b], max_seq_len=64)
    try:
        assert _rows(pool.run_batch(prompts, PARAMS, seed=SEED)) == expected
        assert pool.live == [b]
        tried = len(a.calls)
        assert 1 <= tried <= len(prompts)
        assert _rows(pool.run_batch(prompts[:2], PARAMS, seed=SEED)) == expected[: 2 * N]
        assert len(a.calls) == tried, "a replica left out gets no more groups"
    finally:
        pool.close()


def test_group_in_flight_when_its_replica_dies_is_sent_again(engines, reference):
    prompts, expected = reference
    b = Replica("http://b", engines[1])
    a = DiesInFlight("http://a", engines[0], other=b)
    pool = ReplicaPool([a, b], max_seq_len=64)
    try:
        got = _rows(pool.run_batch(prompts, PARAMS, seed=SEED))
    finally:
        pool.close()
    assert got == expected
    assert len(a.calls) >= 1 and pool.live == [b]
    lost = {tuple(c[0][0]) for c in a.calls}
    assert lost <= {tuple(c[0][0]) for c in b.calls}, "every lost group answered by b"


def test_no_replica_left_is_an_error_naming_them(engines):
    a, b = Replica("http://a", engines[0]), Replica("http://b", engines[1])
    a.fail = b.fail = ReplicaUnavailable("down")
    pool = ReplicaPool([a, b], max_seq_len=64)
    try:
        with pytest.raises(ReplicaUnavailable, match=r"no rollout replica left.*http://a"):
            pool.run_batch([[5, 6]], PARAMS, seed=0)
    finally:
        pool.close()


def test_refusals_are_raised_with_the_replica_message_not_retried(engines):
    a, b = Replica("http://a", engines[0], version=3), Replica("http://b", engines[1], version=3)
    pool = ReplicaPool([a, b], max_seq_len=64)
    try:
        pool.required_version = 3
        assert len(pool.run_batch([[5, 6, 7]], PARAMS, seed=0)) == N
        assert (a.calls + b.calls)[0][2] == 3, "the required version travels"
        pool.required_version = 4
        with pytest.raises(StalePolicyVersion, match="asks for 4, holds 3"):
            pool.run_batch([[5, 6, 7]], PARAMS, seed=0)
        a.fail = b.fail = ReplicaError("http://a/generate: 400: max_tokens too large", status=400)
        with pytest.raises(ReplicaError, match="max_tokens too large"):
            pool.run_batch([[5, 6, 7]], PARAMS, seed=0)
        assert pool.live == [a, b], "a refusal leaves no replica out"
    finally:
        pool.close()


def test_use_restricts_generation_to_the_replicas_that_took_the_weights(engines):
    a, b = Replica("http://a", engines[0]), Replica("http://b", engines[1])
    pool = ReplicaPool([a, b], max_seq_len=64)
    try:
        pool.use([b])
        pool.run_batch([[5, 6], [7, 8, 9]], PARAMS, seed=0)
        assert not a.calls and len(b.calls) == 2
    finally:
        pool.close()
