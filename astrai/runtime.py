"""What every command (`train`, `serve`, `generate`, `eval`, `bench`) sets up first.

One home for three process-wide choices that a library must not make at import:

- **Log level and quiet output** (`setup_logging`): each line once (Lightning gives its
  `lightning` logger a stderr handler *and* lets records reach the root logger that Hydra
  configures, so every Lightning line printed twice), no logger advertisement, W&B's banner
  off, and third-party warnings that a user of ours cannot act on filtered by message and
  module (`QUIET_WARNINGS`). `log_level=debug` keeps everything.
- **Torch thread counts** (`choose_threads`, `set_threads`): torch starts one intra-op
  thread per core whatever else runs; on a busy machine the threads of several processes
  then fight for the same cores and a run collapses instead of slowing down in proportion
  (on 2 cores under load 7-11, a matmul loop ran 20x slower with 2 threads than with 1;
  docs/training.md). The default takes the cores this process may use and leaves out
  those that other work keeps busy (`busy_cores`): the busier of two readings
  (`LoadReadings`), a quarter-second sample of /proc/stat (sees a competitor that started a
  moment ago) and the 1-minute load average (sees bursty load that the sample caught in a
  lull). Too many threads cost far more than too few (a collapse against at most the
  cores left unused), so the higher reading counts, even though the load average still
  remembers a run that ended less than a minute ago.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import sys
import time
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

__all__ = [
    "QUIET_WARNINGS",
    "LoadReadings",
    "available_cores",
    "busy_cores",
    "choose_threads",
    "configure",
    "load_average",
    "read_load",
    "sampled_busy_cores",
    "set_threads",
    "setup_logging",
]

log = logging.getLogger("astrai")

#: (message regex, module regex) of warnings nobody running our commands can act on.
QUIET_WARNINGS: tuple[tuple[str, str], ...] = (
    # InterruptCheckpoint is an OnExceptionCheckpoint, so Lightning reads ckpt_path=None as
    # "last" and warns; `ckpt_path` is resolved by astrai.train.runner before fit.
    (r".*ckpt_path=None\)` was called without a model", r"lightning\."),
    (r".*ckpt_path=\"last\"\) is set, but there is no last checkpoint", r"lightning\."),
    # Lightning's own code against a newer torch
    (r".*isinstance\(treespec, LeafSpec\)` is deprecated", r"lightning\."),
    # the DataLoader worker count: our data is tokenized once into H5 and read by slicing, so
    # more workers do not help (data.num_workers sets them)
    (r".*does not have many workers which may be a bottleneck", r"lightning\."),
    # a run without validation data (GRPO's prompts, limit_val_batches=0)
    (r".*Total length of `\w+` across ranks is zero", r"lightning\."),
    # pydantic / protobuf deprecations inside W&B
    (r".*", r"wandb\."),
    # tqdm's own (clamping a bar's fraction, notebook widgets): progress bars only
    (r".*", r"tqdm\."),
)

#: Lightning INFO lines that advertise a product rather than report on the run.
_ADVERTS = ("litlogger", "💡 Tip:")


class _DropAdverts(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not any(text in message for text in _ADVERTS)


def _level(name: Any) -> int:
    value = logging.getLevelName(str(name or "info").upper())
    if not isinstance(value, int):
        raise SystemExit(f"log_level={name!r}: use debug, info, warning or error")
    return value


def setup_logging(log_level: str | None = "info", *, lightning: bool = False) -> int:
    """Set the root log level and, unless it is `debug`, quiet the third parties.

    `lightning=True` imports Lightning (commands that train; done anyway when it is imported
    already) and removes the stderr handler it adds to its `lightning` logger when the root
    logger already has one: its lines then print once, through the root's handlers (Hydra's:
    terminal and the run's log file). Returns the level.
    """
    level = _level(log_level)
    root = logging.getLogger()
    if root.level == logging.DEBUG:  # `hydra.verbose=true` asked for everything already
        level = logging.DEBUG
    root.setLevel(level)
    verbose = level <= logging.DEBUG
    if not verbose:
        for message, module in QUIET_WARNINGS:
            warnings.filterwarnings("ignore", message=message, module=module)
        os.environ.setdefault("WANDB_QUIET", "true")  # no banner; errors still print
    if lightning or "lightning" in sys.modules:
        import lightning as _lightning  # noqa: F401  (its import adds the handler)

        if logging.getLogger().handlers:
            for name in ("lightning", "lightning.pytorch", "lightning.fabric"):
                logger = logging.getLogger(name)
                for handler in list(logger.handlers):
                    if type(handler) is logging.StreamHandler:
                        logger.removeHandler(handler)
                logger.propagate = True
        rank_zero = logging.getLogger("lightning.pytorch.utilities.rank_zero")
        if not verbose and not any(isinstance(f, _DropAdverts) for f in rank_zero.filters):
            rank_zero.addFilter(_DropAdverts())  # (once: a sweep calls this per job)
    return level


# ------------------------------------------------------------------------------- threads
def available_cores() -> int:
    """Cores this process may run on (its CPU affinity, e.g. a container's or taskset's)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # not Linux
        return max(1, os.cpu_count() or 1)


def _cpu_times(cores: set[int]) -> tuple[float, float]:
    """(busy, total) jiffies of `cores`, summed, from /proc/stat."""
    busy = total = 0.0
    with open("/proc/stat") as f:
        for line in f:
            name, *fields = line.split()
            if not name.startswith("cpu") or name == "cpu" or int(name[3:]) not in cores:
                continue
            ticks = [float(x) for x in fields]
            idle = ticks[3] + (ticks[4] if len(ticks) > 4 else 0.0)  # idle + iowait
            total += sum(ticks[:8])  # guest time is already in user time
            busy += sum(ticks[:8]) - idle
    return busy, total


def sampled_busy_cores(window: float = 0.25) -> float | None:
    """How many of this process's cores other work kept busy over the last `window` seconds,
    from /proc/stat while this process sleeps; None off Linux."""
    try:
        cores = os.sched_getaffinity(0)
        busy0, total0 = _cpu_times(cores)
        time.sleep(window)
        busy1, total1 = _cpu_times(cores)
    except (AttributeError, OSError, ValueError):
        return None
    return len(cores) * (busy1 - busy0) / (total1 - total0) if total1 > total0 else None


def load_average() -> float | None:
    """The 1-minute load average, scaled to the share of the machine's cores this process may
    use (a container pinned to 2 of 64 cores does not see the other 62 cores' load as its
    own); None where the system has none."""
    try:
        load = os.getloadavg()[0]
    except (AttributeError, OSError):
        return None
    return load * available_cores() / max(1, os.cpu_count() or 1)


@dataclass(frozen=True)
class LoadReadings:
    """What other work keeps busy, read two ways (`read_load`); None: not available here."""

    sampled: float | None  # busy cores over a quarter of a second (/proc/stat)
    load_average: float | None  # the 1-minute load average, on this process's cores

    @property
    def busy(self) -> float | None:
        """The busier reading (None when neither is known): the sample alone takes a lull of
        bursty load for an idle machine (2 threads next to 4 busy processes: 2.5x slower),
        the load average alone misses a competitor that started a moment ago."""
        known = [x for x in (self.sampled, self.load_average) if x is not None and x == x]
        return max(known) if known else None

    def describe(self) -> str:
        """The readings as the log line shows them: `0.0 now, 3.8 over 1 min`."""
        show = ["?" if x is None else f"{x:.1f}" for x in (self.sampled, self.load_average)]
        return f"{show[0]} now, {show[1]} over 1 min"


def read_load(window: float = 0.25) -> LoadReadings:
    """Both readings of the machine's load, now (`window` seconds of /proc/stat)."""
    return LoadReadings(sampled_busy_cores(window), load_average())


def busy_cores(window: float = 0.25) -> float | None:
    """How many of this process's cores other work keeps busy: `read_load(window).busy`."""
    return read_load(window).busy


def choose_threads(cores: int, load: float | None, requested: int | None = None) -> int:
    """Torch intra-op threads: `requested` when given (> 0), else the cores that `load` (the
    cores other work keeps busy, `LoadReadings.busy`) leaves free, at least 1.

    A quiet 2-core machine gets 2; with one busy process (load 1.2) 1; under load 8 still
    1, so that our process takes its share of the cores instead of fighting for all of them.
    """
    if requested is not None and int(requested) > 0:
        return int(requested)
    cores = max(1, int(cores))
    if load is None or load != load:  # unknown (or NaN): all the cores
        return cores
    return max(1, min(cores, math.ceil(cores - max(0.0, float(load)) - 1e-9)))


def set_threads(requested: int | None = None) -> int:
    """Apply the thread policy to torch (intra-op as `choose_threads`, inter-op 1) and log
    the choice once. `requested` (the `threads=` key) wins, then `OMP_NUM_THREADS`, which
    torch already honours and which is left alone."""
    import torch

    policy = requested is None or int(requested) <= 0
    if policy and os.environ.get("OMP_NUM_THREADS"):
        n, why = torch.get_num_threads(), "OMP_NUM_THREADS"
    elif policy:
        cores, load = available_cores(), read_load()
        n, why = choose_threads(cores, load.busy), f"{cores} cores; busy: {load.describe()}"
        torch.set_num_threads(n)
    else:
        n, why = int(requested), "threads="
        torch.set_num_threads(n)
    # raises once parallel work has started (a second call in one process): keep what is set
    with contextlib.suppress(RuntimeError):
        torch.set_num_interop_threads(1)
    log.info("torch threads: %d (%s); threads=N sets another count", n, why)
    return n


def configure(cfg: Mapping[str, Any], *, lightning: bool = False) -> None:
    """What an entry point calls with its composed config: `log_level` and `threads`."""
    setup_logging(cfg.get("log_level", "info"), lightning=lightning)
    set_threads(cfg.get("threads"))
