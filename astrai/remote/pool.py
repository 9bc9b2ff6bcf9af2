"""`ReplicaPool`: rollout replicas behind the part of the engine API that GRPO samples
with (``run_batch``, ``max_seq_len``, ``policy_version``).

A call's prompt groups are dispatched concurrently, each whole to one replica (prompt
``i``'s ``n`` samples in one `/generate` of that prompt alone, seeded ``seed + i * n``:
its KV pages stay together, and with the engine's ``batch_invariant`` option its results
equal the in-process ``run_batch``'s bit for bit). A group goes to the live replica with
the fewest groups in flight. A replica that cannot be reached, drops the connection or
fails (`ReplicaUnavailable`) is left out from then on and its group is sent again to
another; a replica that refuses a group (`ReplicaError`, `StalePolicyVersion`) is a real
error, raised with the replica's message. With ``required_version`` set, every request
asks for that policy version: a replica that holds other weights answers 409, never
silently generates with them.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

from astrai.inference.params import SamplingParams
from astrai.remote.client import RemoteResult, ReplicaClient, ReplicaUnavailable

logger = logging.getLogger(__name__)

GROUPS_IN_FLIGHT = 64  # requests one pool keeps open at once (the replicas batch them)


class ReplicaPool:
    """Prompt groups dispatched over ``clients``' replicas.

    Args:
        clients: one per replica (each a `python -m astrai.serve` process).
        max_seq_len: the context every replica's engine has at least (the trainer's
            rollout engine size; multi-turn episodes stop before it).
    Attributes:
        policy_version: the trainer's policy version the replicas hold (its optimizer
            step: what samples record), set by whoever pushes weights.
        required_version: the replicas' own version of those weights, asked of every
            request (None: any).
        live: the replicas still in use.
    """

    def __init__(self, clients: Sequence[ReplicaClient], *, max_seq_len: int) -> None:
        if not clients:
            raise ValueError("ReplicaPool: at least one replica")
        self.clients = list(clients)
        self.live = list(clients)
        self.max_seq_len = int(max_seq_len)
        self.policy_version = 0
        self.required_version: int | None = None
        self.in_flight = {id(c): 0 for c in self.clients}
        self.lock = threading.Lock()
        self.executor: ThreadPoolExecutor | None = None  # started by the first run_batch

    def use(self, clients: Sequence[ReplicaClient]) -> None:
        """Generate on ``clients`` only (those that took the last weight update)."""
        with self.lock:
            self.live = [c for c in self.clients if c in clients]

    def run_batch(
        self,
        prompts: Sequence[Sequence[int]],
        params: SamplingParams,
        *,
        seed: int | None = None,
        return_details: bool = True,
    ) -> list[RemoteResult]:
        """``len(prompts) * params.n`` results, prompt-major, as
        ``InferenceEngine.run_batch(prompts, params, seed=seed, return_details=True)``
        gives them (results always carry their details)."""
        n = params.n
        with self.lock:
            if self.executor is None:
                self.executor = ThreadPoolExecutor(
                    GROUPS_IN_FLIGHT, thread_name_prefix="astrai-pool"
                )
            executor = self.executor
        futures = [
            executor.submit(
                self.generate_group, list(p), params, None if seed is None else seed + i * n
            )
            for i, p in enumerate(prompts)
        ]
        out: list[RemoteResult] = []
        for future in futures:
            out += future.result()
        return out

    def generate_group(
        self, prompt: Sequence[int], params: SamplingParams, seed: int | None
    ) -> list[RemoteResult]:
        """One prompt's ``n`` samples from one replica; sent again to another while the
        chosen one turns out unavailable."""
        while True:
            client = self.pick()
            try:
                return client.generate(
                    [prompt], params, seed=seed, policy_version=self.required_version
                )
            except ReplicaUnavailable as err:
                self.leave_out(client, err)
            finally:
                with self.lock:
                    self.in_flight[id(client)] -= 1

    def pick(self) -> ReplicaClient:
        """The live replica with the fewest groups in flight (counted as one more)."""
        with self.lock:
            if not self.live:
                raise ReplicaUnavailable(
                    f"no rollout replica left: all of {[c.url for c in self.clients]} failed"
                )
            client = min(self.live, key=lambda c: self.in_flight[id(c)])
            self.in_flight[id(client)] += 1
            return client

    def leave_out(self, client: ReplicaClient, err: Exception) -> None:
        with self.lock:
            if client in self.live:
                self.live.remove(client)
                logger.warning(
                    "rollout replica %s left out (%s); %d left", client.url, err, len(self.live)
                )

    def close(self) -> None:
        """Stop the dispatch threads (a later ``run_batch`` starts new ones)."""
        with self.lock:
            executor, self.executor = self.executor, None
        if executor is not None:
            executor.shutdown(wait=False, cancel_futures=True)


__all__ = ["ReplicaPool"]
