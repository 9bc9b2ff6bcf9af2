"""`WeightSender`: a trainer pushes its policy's weights to its replicas.

Over a `torch.distributed` group (`weight_group.py`; SGLang's
`/update_weights_from_distributed`, TRL's `vllm-serve` communicator): the trainer is rank
0 and hosts the group's store; each replica joins at its rank. A push sends every
replica the names, shapes and dtypes first (HTTP, in parallel); every member then takes
part in one handshake (all agree or all refuse: a refused update changes no replica),
and the tensors follow one by one by broadcast. The replicas' answers come when their
copy is done. A member that died is noticed by the collectives (its connections close);
the group is then given up (its survivors stop waiting at once), formed again over the
replicas that still answer `/health`, and the push is retried once over them.
"""

from __future__ import annotations

import concurrent.futures as cf
import itertools
import logging
import os
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch

from astrai.remote.client import ReplicaClient, ReplicaError, ReplicaUnavailable
from astrai.remote.weight_group import WeightGroup, WeightStore, check_backend
from astrai.remote.wire import dtype_name

logger = logging.getLogger(__name__)

ANSWER_GRACE_S = 2.0  # a replica answered with an error: how long the handshake may still finish
POLL_S = 0.0005


class GroupBroken(RuntimeError):
    """The group cannot carry this push (a member died or lost the group): form it again."""


def in_background(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> cf.Future:
    """`fn(...)` on a daemon thread (one stuck on a dead peer never holds the exit up)."""
    future: cf.Future = cf.Future()

    def run() -> None:
        try:
            future.set_result(fn(*args, **kwargs))
        except BaseException as err:  # handed to whoever reads the future
            future.set_exception(err)

    threading.Thread(target=run, name="astrai-weight-sender", daemon=True).start()
    return future


def first_error(futures: Sequence[cf.Future]) -> BaseException | None:
    for f in futures:
        if f.done() and f.exception() is not None:
            return f.exception()
    return None


class WeightSender:
    """Pushes weights to `clients`' replicas (which must run with `allow_weight_updates`).

    `master_address` must be reachable from the replicas (the trainer's address);
    `master_port` 0 picks a free port. `backend`: ``gloo`` (tensors go through the CPU)
    or ``nccl`` (GPU to GPU; the trainer's current CUDA device). `timeout` (seconds)
    bounds the group's formation and each of its collectives.
    """

    def __init__(
        self,
        clients: Sequence[ReplicaClient],
        *,
        master_address: str = "127.0.0.1",
        master_port: int = 0,
        backend: str = "gloo",
        timeout: float = 300,
    ) -> None:
        if not clients:
            raise ValueError("clients: at least one replica")
        self.clients = list(clients)
        self.master_address = master_address
        self.master_port = master_port
        self.backend = check_backend(backend)
        self.timeout = timeout
        self.alive: list[ReplicaClient] = []
        self.group: WeightGroup | None = None
        self.store: WeightStore | None = None
        self._formations = itertools.count()

    # ------------------------------------------------------------------ the group
    def form(self, members: Sequence[ReplicaClient] | None = None) -> WeightGroup:
        """A new group over `members` (None: the replicas that answer `/health`); one that
        then fails to join is left out, and the group formed again without it."""
        self.drop()
        if self.store is None:
            self.store = WeightStore(self.master_address, self.master_port, self.timeout)
        members = [c for c in self.clients if c.health()] if members is None else list(members)
        while members:
            name = f"astrai-weights-{os.getpid()}-{next(self._formations)}"
            world = len(members) + 1
            joins = [
                in_background(
                    c.init_weights_update_group,
                    self.master_address,
                    self.store.port,
                    k + 1,
                    world,
                    name,
                    self.backend,
                )
                for k, c in enumerate(members)
            ]
            own = in_background(
                WeightGroup,
                self.store.store,
                name=name,
                rank=0,
                world_size=world,
                backend=self.backend,
                timeout=self.timeout,
            )
            while not own.done() and first_error(joins) is None:
                time.sleep(0.01)
            failed = [c for c, f in zip(members, joins) if f.done() and f.exception()]
            if own.done() and own.exception() is None and not failed:
                cf.wait(joins)
                self.group, self.alive = own.result(), members
                logger.info("weight group %r formed with %d replica(s)", name, len(members))
                return self.group
            for c, f in zip(members, joins):
                if f.done() and f.exception():
                    logger.warning(
                        "replica %s did not join weight group %r: %s", c.url, name, f.exception()
                    )
            if not failed:  # our own side failed: nothing a retry would change
                raise ReplicaUnavailable(f"weight group {name!r}: {own.exception()}")
            members = [c for c in members if c not in failed]
        self.alive = []
        raise ReplicaUnavailable(f"no replica reachable for a weight group: {self.clients}")

    def drop(self) -> None:
        """Give the current group up: members still waiting on it fail at once."""
        if self.group is not None:
            self.group.abort()
            self.group.close()
            self.group = None

    # ------------------------------------------------------------------ pushes
    def push(
        self,
        named: Iterable[tuple[str, torch.Tensor]],
        version: int,
        lora_name: str | None = None,
    ) -> float:
        """Send `named` tensors (the model's `named_parameters()` or `state_dict()`
        names, or a LoRA adapter's with `lora_name`) as policy `version` to every live
        replica; the seconds it took. `ReplicaError` when the replicas refuse it (none
        changed; the message is the refusing replica's); `ReplicaUnavailable` when no
        replica could take it. Tensors are sent one at a time (a GPU tensor with gloo is
        copied to the CPU one at a time): hand references, not copies."""
        start = time.perf_counter()
        tensors = [(name, t.detach()) for name, t in named]
        group = self.group or self.form()
        try:
            self._push_over(group, tensors, version, lora_name)
        except GroupBroken as err:
            logger.warning(
                "weight push over %r failed (%s); forming the group again", group.name, err
            )
            self.drop()
            self._retry(tensors, version, lora_name, err)
        return time.perf_counter() - start

    def _retry(
        self,
        tensors: list[tuple[str, torch.Tensor]],
        version: int,
        lora_name: str | None,
        first: Exception,
    ) -> None:
        """The push again over the replicas still answering that do not hold `version` yet
        (those that completed the first attempt do: they would refuse it as not newer)."""
        survivors, behind = [], []
        for c in self.clients:
            try:
                held = c.policy_version()
            except (ReplicaError, ReplicaUnavailable):
                continue
            survivors.append(c)
            if held < version:
                behind.append(c)
        if not survivors:
            raise ReplicaUnavailable(f"no replica left after a failed weight push: {first}")
        if behind:
            group = self.form(behind)
            try:
                self._push_over(group, tensors, version, lora_name)
            except GroupBroken as err:
                self.drop()
                raise ReplicaUnavailable(f"weight push failed twice: {err}") from err
            if len(behind) < len(survivors):
                self.drop()  # the next push forms the group over all of them
        self.alive = survivors

    def _push_over(
        self,
        group: WeightGroup,
        tensors: list[tuple[str, torch.Tensor]],
        version: int,
        lora_name: str | None,
    ) -> None:
        names = [n for n, _ in tensors]
        dtypes = [dtype_name(t.dtype) for _, t in tensors]
        shapes = [list(t.shape) for _, t in tensors]
        answers = [
            in_background(
                c.update_weights_from_distributed,
                names,
                dtypes,
                shapes,
                version=version,
                group_name=group.name,
                lora_name=lora_name,
            )
            for c in self.alive
        ]
        work, flag = group.start_handshake(True)
        self._wait_handshake(work, answers)
        if not flag.item():  # refused: every replica answers 400, one of them says why
            cf.wait(answers)
            errors = [f.exception() for f in answers if f.exception() is not None]
            own = [e for e in errors if isinstance(e, ReplicaError) and e.code != "refused_by_peer"]
            raise (own or errors or [ReplicaError("weight update refused", status=400)])[0]
        try:
            for _, t in tensors:
                group.broadcast(t.to(group.device).contiguous())
        except Exception as err:  # a member died mid-transfer: its connections closed
            raise GroupBroken(f"broadcast failed: {err}") from err
        cf.wait(answers)
        err = first_error(answers)
        if isinstance(err, ReplicaError):
            raise err
        if err is not None:
            raise GroupBroken(f"a replica failed after the transfer: {err}")

    def _wait_handshake(self, work: Any, answers: Sequence[cf.Future]) -> None:
        """Until the handshake completes; a replica that answered (with an error) before
        it took part never will: the group is broken (it lost the group, or died)."""
        answered_at = None
        while not work.is_completed():
            err = first_error(answers)
            if err is not None:
                answered_at = answered_at or time.monotonic()
                if time.monotonic() - answered_at > ANSWER_GRACE_S:
                    raise GroupBroken(f"a replica left before the handshake: {err}")
            time.sleep(POLL_S)
        try:
            work.wait()
        except Exception as err:  # a member's connection closed
            raise GroupBroken(f"handshake failed: {err}") from err

    def push_from_disk(self, path: str, version: int, lora_name: str | None = None) -> float:
        """Every live replica loads the safetensors directory `path` (which they must be
        able to read) as policy `version`; the seconds it took. Each replica checks and
        refuses on its own (no handshake): a `ReplicaError` is the first refusal."""
        start = time.perf_counter()
        targets = self.alive or [c for c in self.clients if c.health()]
        answers = [
            in_background(c.update_weights_from_disk, path, version, lora_name) for c in targets
        ]
        cf.wait(answers)
        err = first_error(answers)
        if err is not None:
            raise err
        return time.perf_counter() - start

    def close(self) -> None:
        """Leave the group on the replicas (best effort) and close the store."""
        if self.group is not None:
            for c in self.alive:
                try:
                    c.destroy_weights_update_group(self.group.name)
                except (ReplicaError, ReplicaUnavailable) as err:
                    logger.debug("%s: %s", c.url, err)
        self.drop()
        self.store = None
        self.alive = []
