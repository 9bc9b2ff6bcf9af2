"""Freeing the calling thread's idle OpenMP team before another thread takes over the compute.

libgomp (the OpenMP runtime of torch's CPU wheels) gives every thread that starts a
parallel region a team of worker threads of its own and keeps it for later regions. Once a
second thread (the engine's loop) starts a team while the first thread's idle workers still
exist, libgomp counts more threads than cores and makes every team wait "throttled": a
worker goes to sleep almost at once after each region, and the next of the hundred-odd
regions of a decode step pays a futex wake-up. On the 2-core benchmark machine, with the
constructing thread having run one 2-thread region (building the model, a synchronous
run), a 16 x 256 x 1024 oneDNN product in the engine's thread took 115 us instead of 54,
and the whole engine ran at 0.6x the speed of the same loop on the constructing thread
(experiments/bench/engine.md). `omp_pause_resource_all` (OpenMP 5.0) frees the calling
thread's team; the thread gets a new one if it runs a parallel region again.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import sys
from pathlib import Path

import torch

logger = logging.getLogger(__name__)


def _loaded_libgomp() -> str | None:
    """The path of the libgomp this process has loaded (torch's own, normally)."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return None
    for line in maps.splitlines():
        path = line.rsplit(" ", 1)[-1]
        if Path(path).name.startswith("libgomp"):
            return path
    return None


@functools.cache
def _pause_all() -> ctypes._CFuncPtr | None:
    if not sys.platform.startswith("linux") or not torch.backends.openmp.is_available():
        return None
    path = _loaded_libgomp()
    if path is None:  # another OpenMP runtime (Intel's), or none loaded
        return None
    try:
        fn = ctypes.CDLL(path).omp_pause_resource_all
    except (OSError, AttributeError):
        return None
    fn.argtypes, fn.restype = [ctypes.c_int], ctypes.c_int
    return fn


OMP_PAUSE_SOFT = 1  # omp_pause_soft: threads released, state kept


def release_idle_team() -> bool:
    """Free the calling thread's idle OpenMP worker threads (libgomp only); True when done.

    Call it on a thread that is about to leave the compute to another one (the engine's
    loop); harmless anywhere outside a parallel region."""
    pause = _pause_all()
    if pause is None:
        return False
    done = pause(OMP_PAUSE_SOFT) == 0
    if not done:
        logger.debug("omp_pause_resource_all refused: the caller is inside a parallel region")
    return done
