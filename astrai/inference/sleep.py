"""Engine sleep: give back the engine's memory while something else needs it, take it back after.

vLLM's sleep mode (`LLM(enable_sleep_mode=True)`, `llm.sleep(level=1)`, `llm.wake_up()`,
`llm.is_sleeping`) and SGLang's `release_memory_occupation` / `resume_memory_occupation` are
the references for the names and the meaning. A training run colocates its rollout engine
with the optimizer (TRL's `vllm_enable_sleep_mode`): while the optimizer steps, the engine's
memory is the optimizer's.

Level 1, the only level: the KV pool's storage (the engine's and a draft model's), the
captured CUDA graphs (their memory pool; they hold the addresses of what is freed) and the
packed projection copies (`astrai.model.packed`) are freed, and handed back to the device
(`return_freed_memory`: CUDA's cache emptied, glibc's heap trimmed on the CPU). The model's
weights stay: they are the trainer's live parameters. The prefix cache is emptied (its pages
die with the pool). Wake-up allocates the pool again at the same size (zeroed, as a fresh
engine's), rebuilds the packs from the weights of that moment and captures the graphs again:
the next generation is that of an engine that never slept. vLLM's level 2 also discards the
weights, for an engine with its own copy; astrai's engine generates with the model it was
given (in training the trainer's parameters), so there is none to discard: refused (an
engine fed a gathered copy under FSDP2 could discard that copy's storage as its level 2).

Requests while asleep: `submit` queues them and they run after `wake_up` (the loop thread,
stopped by `sleep`, restarts then); `run_batch` and `score`, which run on the calling thread,
raise `EngineSleeping`. Weight updates (`update_weights`) are allowed: they touch no KV.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
from collections.abc import Sequence
from typing import Any, Protocol

import torch

from astrai.inference.cache import PagePool
from astrai.inference.engine_options import check_sleep_mode
from astrai.inference.errors import EngineNotReady
from astrai.model.packed import ProjectionPacks

logger = logging.getLogger(__name__)

SLEEP_LEVELS = (1,)


class EngineSleeping(EngineNotReady):
    """The engine is asleep (`InferenceEngine.sleep`): call `wake_up()` first."""


class Graphs(Protocol):
    """The runner's captured decode graphs (`ModelRunner`)."""

    def release_graphs(self) -> bool: ...

    def capture_graphs(self) -> None: ...


def return_freed_memory(device: torch.device) -> None:
    """Hand what was freed back to the device: CUDA's caching allocator empties its cache; on
    the CPU glibc's `malloc_trim` returns the heap's free pages (the packs' many small
    tensors stay in the process's heap otherwise; measured: astrai-30m's 158 MiB of packs
    left the RSS only with it). Elsewhere (another C library) nothing."""
    if device.type == "cuda":
        torch.cuda.empty_cache()
        return
    with contextlib.suppress(AttributeError, OSError):  # AttributeError: not glibc
        ctypes.CDLL(None).malloc_trim(0)


class SleepMode:
    """What the engine's sleep frees and its wake-up takes back, and whether it sleeps.

    `pools`: the KV pools (the engine's, a draft model's); `graphs`: the runner;
    `packs`: the engine's hold on the model's packs.
    """

    def __init__(
        self,
        enabled: bool,
        *,
        pools: Sequence[PagePool],
        graphs: Graphs,
        packs: ProjectionPacks,
        device: torch.device,
    ) -> None:
        self.enabled = check_sleep_mode(enabled)
        self.pools = tuple(pools)
        self.graphs = graphs
        self.packs = packs
        self.device = device
        self.level: int | None = None  # None: awake
        self.restart_loop = False  # the loop thread ran (or was started) while asleep
        self.had_graphs = False
        self.sleeps = 0  # sleeps over the engine's life
        self.freed_bytes = 0  # what the last sleep freed (KV pools and packs)

    @property
    def asleep(self) -> bool:
        return self.level is not None

    @property
    def kv_allocated_bytes(self) -> int:
        """Bytes the KV pools hold now (0 while asleep)."""
        return sum(pool.kv_allocated_bytes for pool in self.pools)

    def check(self, level: Any) -> None:
        if not self.enabled:
            raise RuntimeError(
                "sleep mode is off: build the engine with enable_sleep_mode=True "
                "(engine.enable_sleep_mode: true)"
            )
        if isinstance(level, bool) or level not in SLEEP_LEVELS:
            raise ValueError(
                f"sleep level must be 1, got {level!r} (level 2, which also discards the "
                "weights in vLLM, has nothing to discard here: the engine generates with the "
                "trainer's live weights)"
            )

    def enter(self, level: int, restart_loop: bool) -> int:
        """Free the memory (the loop thread is stopped); the bytes freed. Requests holding
        KV make it a RuntimeError, with nothing freed."""
        if not all(pool.all_free() for pool in self.pools):
            raise RuntimeError("cannot sleep while requests hold KV; let them finish first")
        self.had_graphs = self.graphs.release_graphs()  # before what they point into goes
        freed = sum(pool.release() for pool in self.pools) + self.packs.release()
        return_freed_memory(self.device)
        self.level, self.restart_loop = level, restart_loop
        self.sleeps += 1
        self.freed_bytes = freed
        logger.debug("engine asleep (level %d): freed %.1f MiB", level, freed / 2**20)
        if self.sleeps == 1:
            logger.info(
                "engine sleep mode: the KV pool and packed projections (%.1f MiB) are freed "
                "at each sleep and taken back at the wake-up (further sleeps log at debug)",
                freed / 2**20,
            )
        return freed

    def leave(self) -> bool:
        """Take the memory back; whether the loop thread should run again."""
        for pool in self.pools:
            pool.resume()
        self.packs.hold()
        if self.had_graphs:
            self.graphs.capture_graphs()
        restart, self.level, self.restart_loop = self.restart_loop, None, False
        logger.debug("engine awake: %.1f MiB taken back", self.freed_bytes / 2**20)
        return restart

    def close(self) -> int:
        """At the engine's shutdown: the graphs and the KV pools go back to the device for
        good, asleep or not (a benchmark builds one engine after another, each pool sized
        from the free memory: on a GPU the fourth found 1.5 GB free without this). Returns
        the bytes freed."""
        self.graphs.release_graphs()
        freed = sum(pool.close() for pool in self.pools)
        return_freed_memory(self.device)
        return freed

    def stats(self) -> dict[str, Any]:
        """`is_sleeping`, `sleep_count` (the pool's `kv_allocated_bytes` is in its stats)."""
        return {"is_sleeping": self.asleep, "sleep_count": self.sleeps}


__all__ = ["EngineSleeping", "SleepMode"]
