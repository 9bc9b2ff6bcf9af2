"""The process group that carries weights from a trainer (rank 0) to its replicas.

Built from a `torch.distributed.TCPStore` with the backend's class
(`ProcessGroupGloo` on CPU, `ProcessGroupNCCL` on GPUs), never `init_process_group`: the
trainer may already have a default group of its own (DDP, FSDP), and a replica's server
has none. The trainer hosts the store (`WeightStore`, `master_port=0`: a free port); each
formation of the group uses its own prefix of it (the group's name), so a group re-formed
over the survivors of a dead replica never meets the old one's keys.

Every member takes part in the same collectives in the same order: `handshake(ok)` (an
all-reduce of one flag: all agree or all refuse) and `broadcast(tensor)` from rank 0. A
member waiting on a collective also watches the store's `abort` key of its group, which
rank 0 sets when it gives the group up (a member died mid-transfer): the survivors fail at
once instead of at the group's timeout.
"""

from __future__ import annotations

import datetime
import logging
import os
import sys
import time

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)

BACKENDS = ("gloo", "nccl")
POLL_S = 0.0002  # how often a waiting member looks at its collective
ABORT_CHECK_S = 0.05  # and at the abort key (a round trip to the store)
ABORT_KEY = "abort"


# Groups closed while a collective was still pending (a member died before joining it):
# their destructor would wait for it until the timeout, and a daemon thread killed in that
# wait aborts the process at exit. Parked here until it completes, then dropped.
_PARKED: list[tuple[dist.ProcessGroup, dist.Work]] = []


def leave_parked_groups() -> None:
    """At a normal stop: a parked group whose collective is still pending would hold the
    interpreter's exit until the group's timeout (its destructor waits for that collective,
    at the last garbage collection), so the process ends here instead, its logs flushed."""
    pending = sum(not work.is_completed() for _, work in _PARKED)
    if not pending:
        return
    logger.warning(
        "%d weight group(s) still wait for a member that died: exiting without waiting "
        "for their timeout",
        pending,
    )
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


class GroupAborted(RuntimeError):
    """Rank 0 gave the group up (a member died); this member's collective was abandoned."""


def check_backend(backend: object) -> str:
    if backend not in BACKENDS:
        raise ValueError(f"backend: must be one of {', '.join(BACKENDS)}, got {backend!r}")
    if backend == "nccl" and not (dist.is_nccl_available() and torch.cuda.is_available()):
        raise ValueError("backend: nccl needs CUDA and a torch built with NCCL; use gloo")
    assert isinstance(backend, str)
    return backend


class WeightStore:
    """The trainer's `TCPStore` (the master), on `port` (0: a free one, then `port` is it)."""

    def __init__(self, address: str, port: int, timeout: float) -> None:
        self.address = address
        self.store = dist.TCPStore(
            address,
            port,
            is_master=True,
            wait_for_workers=False,
            timeout=datetime.timedelta(seconds=timeout),
        )
        self.port = int(self.store.port)


def _process_group(
    store: dist.Store,
    rank: int,
    world_size: int,
    backend: str,
    timeout: float,
    device: torch.device | None,
) -> tuple[dist.ProcessGroup, torch.device]:
    delta = datetime.timedelta(seconds=timeout)
    if backend == "nccl":  # its own timeout stays NCCL's; `_wait` bounds the replicas'
        from torch.distributed import ProcessGroupNCCL

        if device is None or device.type != "cuda":
            device = torch.device("cuda", torch.cuda.current_device())
        return ProcessGroupNCCL(store, rank, world_size), device
    return dist.ProcessGroupGloo(store, rank, world_size, delta), torch.device("cpu")


class WeightGroup:
    """One formation of the group: this member's rank, the backend's group, its device
    (where tensors go through it: CPU for gloo, this process's GPU for NCCL)."""

    def __init__(
        self,
        store: dist.Store,
        *,
        name: str,
        rank: int,
        world_size: int,
        backend: str = "gloo",
        timeout: float = 300.0,
        device: torch.device | None = None,
    ) -> None:
        check_backend(backend)
        if world_size < 2 or not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} of world_size {world_size}: not a member")
        self.name = name
        self.rank = rank
        self.world_size = world_size
        self.backend = backend
        self.timeout = timeout
        self.store = dist.PrefixStore(f"astrai-weights/{name}/", store)
        self.pending: dist.Work | None = None  # the last collective started (they run in order)
        # Blocks until every member has constructed its side (gloo connects the full mesh).
        self.group, self.device = _process_group(
            self.store, rank, world_size, backend, timeout, device
        )
        self.handshake(True)  # NCCL connects on its first collective: every member joined

    @classmethod
    def join(
        cls,
        master_address: str,
        master_port: int,
        *,
        name: str,
        rank: int,
        world_size: int,
        backend: str = "gloo",
        timeout: float = 300.0,
        device: torch.device | None = None,
    ) -> WeightGroup:
        """A replica's side: connect to the trainer's store and join as `rank` (`device`:
        the engine's, where NCCL receives)."""
        store = dist.TCPStore(
            master_address,
            master_port,
            is_master=False,
            timeout=datetime.timedelta(seconds=timeout),
        )
        return cls(
            store,
            name=name,
            rank=rank,
            world_size=world_size,
            backend=backend,
            timeout=timeout,
            device=device,
        )

    # ------------------------------------------------------------------ collectives
    def _wait(self, work: dist.Work) -> None:
        """Until `work` completes (its error raised, if it failed). Rank 0 just waits (a
        dead member fails its sends at once); the others also give up when rank 0 aborts
        the group, or after the group's timeout."""
        if self.rank == 0:
            work.wait()
            return
        now = time.monotonic()
        deadline, next_check = now + self.timeout, now + ABORT_CHECK_S
        while not work.is_completed():
            time.sleep(POLL_S)
            now = time.monotonic()
            if now >= next_check:
                next_check = now + ABORT_CHECK_S
                if self.aborted():
                    raise GroupAborted(f"weight group {self.name!r} was aborted by rank 0")
                if now > deadline:
                    raise TimeoutError(
                        f"weight group {self.name!r}: no progress in {self.timeout} s"
                    )
        work.wait()

    def handshake(self, ok: bool) -> bool:
        """All-reduce (min) of one flag: True when every member said ok."""
        flag = torch.tensor([1 if ok else 0], dtype=torch.int32, device=self.device)
        options = dist.AllreduceOptions()
        options.reduceOp = dist.ReduceOp.MIN
        self._wait(self._started(self.group.allreduce([flag], options)))
        return bool(flag.item())

    def start_handshake(self, ok: bool) -> tuple[dist.Work, torch.Tensor]:
        """`handshake` without the wait: rank 0 watches the replicas' answers meanwhile."""
        flag = torch.tensor([1 if ok else 0], dtype=torch.int32, device=self.device)
        options = dist.AllreduceOptions()
        options.reduceOp = dist.ReduceOp.MIN
        return self._started(self.group.allreduce([flag], options)), flag

    def broadcast(self, tensor: torch.Tensor) -> None:
        """`tensor` from rank 0 into every member's `tensor` (same shape and dtype)."""
        self._wait(self._started(self.group.broadcast(tensor, 0)))

    def _started(self, work: dist.Work) -> dist.Work:
        self.pending = work
        return work

    # ------------------------------------------------------------------ ending
    def abort(self) -> None:
        """Rank 0 gives the group up: members waiting on a collective fail now."""
        try:
            self.store.set(ABORT_KEY, "1")
        except Exception as err:  # the store's own connection errors: nothing to tell
            logger.debug("weight group %r: could not set its abort key: %s", self.name, err)

    def aborted(self) -> bool:
        try:
            return bool(self.store.check([ABORT_KEY]))
        except Exception:  # the store (the trainer) is gone: the group is
            return True

    def close(self) -> None:
        """Drop the group; one whose last collective is still pending is parked until that
        collective ends (its destructor would wait for it)."""
        group, self.group = self.group, None  # type: ignore[assignment]
        if group is not None and self.pending is not None and not self.pending.is_completed():
            _PARKED.append((group, self.pending))
        self.pending = None
        _PARKED[:] = [(g, w) for g, w in _PARKED if not w.is_completed()]
