"""GRPO's rollout engine in server mode: the replicas (`python -m astrai.serve`) behind a
:class:`~astrai.remote.pool.ReplicaPool`, kept on the trainer's policy version.

:class:`RemotePolicy` stands where :class:`~astrai.train.policy_engine.PolicyEngine` stands
in a colocated run: ``sync(step)`` brings the generator up to optimizer step ``step`` and
returns what GRPO samples on (:class:`PolicyAt`: the pool at that step). A step whose
weights the replicas do not hold is pushed first, once (:class:`~astrai.remote.weight_sender.WeightSender` over a
``torch.distributed`` group: the trainer is rank 0, every replica receives each tensor by
broadcast), from rank 0 of the trainer; the other ranks take part in the gather of the
shards under FSDP2 and then learn the outcome (one ``broadcast_object_list``). The
replicas' own version numbers only go up; a push gets the next one after the highest a
replica reported, so replicas that served an earlier run take the weights of a new one.
Every generation asks for that version: a replica with other weights answers 409, never
silently. A replica that missed a push (dead, left out of the group) gets no more groups.
The trainer's sampler and the asynchronous generator share the replicas: a generation holds
them (one lock) and first pushes its own step's weights again if the other pushed others.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from torch import Tensor

from astrai.inference.params import SamplingParams
from astrai.remote.client import RemoteResult, ReplicaClient, ReplicaError, ReplicaUnavailable
from astrai.remote.pool import ReplicaPool
from astrai.remote.weight_sender import WeightSender

log = logging.getLogger(__name__)

PUSH_TRIES = 3
PUSH_PAUSE_S = 1.0

#: ``named(step)``: the weights of optimizer step ``step`` as (state-dict name, tensor)
Named = Callable[[int], Iterable[tuple[str, Tensor]]]


def _world() -> tuple[int, int]:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    return 0, 1


class RolloutChannel:
    """The replicas of a run: the pool that generates on them, the sender that pushes to
    them, and the trainer step whose weights they hold (None: none pushed yet). Shared by
    the run's remote policies (the trainer's and the asynchronous generator's)."""

    def __init__(self, pool: ReplicaPool, sender: WeightSender) -> None:
        self.pool = pool
        self.sender = sender
        self.step: int | None = None
        self.wire_version: int | None = None  # the replicas' version of those weights
        self.push_seconds = 0.0  # of the last push
        self.lock = threading.RLock()  # a push, and a generation that needs its weights

    def holds(self) -> int | None:
        """The trainer step whose weights the replicas hold (None: none pushed yet)."""
        return self.step

    def next_version(self) -> int:
        """One past the highest version a replica holds (the first push asks them)."""
        if self.wire_version is not None:
            return self.wire_version + 1
        versions = []
        for client in self.pool.clients:
            try:
                versions.append(client.policy_version())
            except (ReplicaUnavailable, ReplicaError) as err:
                log.warning("rollout replica %s: no policy version (%s)", client.url, err)
        if not versions:
            raise ReplicaUnavailable(
                "strategy.rollout.servers: no replica answers "
                f"({[c.url for c in self.pool.clients]}); start them first (docs/scaling.md)"
            )
        return max(versions) + 1

    def push(self, named: Iterable[tuple[str, Tensor]]) -> tuple[int, list[str]]:
        """Push ``named`` as the next version; (that version, the urls that took it). A
        push that reached no replica is tried again ``PUSH_TRIES`` times, ``PUSH_PAUSE_S``
        apart: a survivor of a broken group may still be failing its part of the old one
        (and closing its connections) when the group is formed again."""
        version = self.next_version()
        tensors = list(named)
        for attempt in range(1, PUSH_TRIES + 1):
            try:
                self.push_seconds = self.sender.push(tensors, version=version)
                break
            except ReplicaUnavailable as err:
                if attempt == PUSH_TRIES:
                    raise
                log.warning("weight push reached no replica (%s); trying again", err)
                time.sleep(PUSH_PAUSE_S)
        log.info(
            "weights pushed to %d replica(s) as version %d in %.3f s",
            len(self.sender.alive),
            version,
            self.push_seconds,
        )
        return version, [c.url for c in self.sender.alive]

    def agree(self, step: int, version: int, urls: list[str]) -> None:
        """Every rank's pool on the pushed weights: their version, the replicas that hold
        them, the trainer step."""
        self.pool.use([c for c in self.pool.clients if c.url in urls])
        self.pool.required_version = version
        self.pool.policy_version = step
        self.step, self.wire_version = step, version

    def close(self) -> None:
        self.sender.close()
        self.pool.close()


class RemotePolicy:
    """The rollout engine of a run in server mode (see the module docstring).

    Args:
        channel: the run's replicas.
        live: ``() -> (model, tokenizer)``, the live policy (its device decides autocast).
        named: the weights of a step (rank 0 pushes them; on every rank it is called
            alike, so a gather of FSDP2 shards inside it is a collective all ranks join).
    """

    def __init__(
        self, channel: RolloutChannel, live: Callable[[], tuple[Any, Any]], named: Named
    ) -> None:
        self.channel = channel
        self.live = live
        self.named = named

    @property
    def pool(self) -> ReplicaPool:
        return self.channel.pool

    def sync(self, step: int, load: Callable[[], Any] | None = None) -> PolicyAt:
        """What to sample on with the weights of ``step``: the pool, its replicas brought
        to them (pushed now unless they hold them; ``load`` first puts them where
        ``named`` reads them)."""
        step = int(step)
        with self.channel.lock:
            if load is not None:  # always: a later re-push of this step reads it
                load()
            self.bring_up(step)
        return PolicyAt(self, step)

    def bring_up(self, step: int) -> None:
        """Push the weights of ``step`` unless the replicas hold them (the caller holds
        the channel's lock). A step older than theirs is pushed too: the asynchronous
        generator's snapshot after validation pushed the live weights."""
        channel = self.channel
        if channel.holds() == step:
            return
        rank, world = _world()
        if world > 1 and threading.current_thread() is not threading.main_thread():
            raise RuntimeError(
                "strategy.rollout.mode=server with strategy.async_rollouts runs on one "
                "trainer process (the push from the generator thread would interleave "
                "with the trainer's collectives); set strategy.async_rollouts=null"
            )
        named = self.named(step)
        outcome: list[Any] = [None]
        if rank == 0:
            outcome = [channel.push(named)]
        if world > 1:
            torch.distributed.broadcast_object_list(outcome, src=0)
        version, urls = outcome[0]
        channel.agree(step, version, urls)

    def join(self, step: int) -> None:
        """Nothing: weights go out at the next :meth:`sync` (GRPO's version bump)."""
        return None

    def close(self) -> None:
        self.channel.close()


class PolicyAt:
    """The pool as one policy version's sampler (what :meth:`RemotePolicy.sync` returns,
    with the engine API GRPO's sampling reads): each ``run_batch`` holds the channel while
    it generates and first brings the replicas back to its step if another user of the
    channel (validation, the asynchronous generator) pushed other weights meanwhile."""

    def __init__(self, policy: RemotePolicy, step: int) -> None:
        self.policy = policy
        self.step = step

    @property
    def max_seq_len(self) -> int:
        return self.policy.pool.max_seq_len

    @property
    def policy_version(self) -> int:
        return self.step

    def run_batch(
        self,
        prompts: Sequence[Sequence[int]],
        params: SamplingParams,
        *,
        seed: int | None = None,
        return_details: bool = True,
        on_group: Callable[[int, list[RemoteResult]], None] | None = None,
    ) -> list[RemoteResult]:
        """The replicas' results; ``on_group(i, results)`` per prompt once they arrive."""
        with self.policy.channel.lock:
            self.policy.bring_up(self.step)
            results = self.policy.pool.run_batch(prompts, params, seed=seed)
        if on_group is not None:
            for i in range(len(prompts)):
                on_group(i, results[i * params.n : (i + 1) * params.n])
        return results


def replica_channel(
    servers: Iterable[str],
    *,
    api_key: str | None,
    timeout: float,
    max_seq_len: int,
    master_address: str,
    master_port: int,
    backend: str,
    sync_timeout: float,
) -> RolloutChannel:
    """A run's channel to the replicas at ``servers`` (nothing is contacted yet)."""
    clients = [ReplicaClient(url, api_key=api_key, timeout=timeout) for url in servers]
    sender = WeightSender(
        clients,
        master_address=master_address,
        master_port=master_port,
        backend=backend,
        timeout=sync_timeout,
    )
    return RolloutChannel(ReplicaPool(clients, max_seq_len=max_seq_len), sender)


__all__ = ["Named", "PolicyAt", "RemotePolicy", "RolloutChannel", "replica_channel"]
