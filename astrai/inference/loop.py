"""The engine's background thread: run steps while there is work, pause for the caller.

`InferenceEngine` drives its step from here (server traffic) or from the calling thread
(`run_batch`, `score`, weight updates), never both at once: `paused()` stops the thread
after the work it has and restarts it afterwards.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable, Iterator

from astrai.extension.omp import release_idle_team
from astrai.inference.handoff import Handoff
from astrai.inference.scheduler import InferenceScheduler

logger = logging.getLogger(__name__)


class EngineLoop:
    """One daemon thread calling `step` while `scheduler` has work; a crash fails every
    request (`InferenceScheduler.fail_all`) and ends the thread (`start` restarts it)."""

    def __init__(
        self, step: Callable[[], None], scheduler: InferenceScheduler, handoff: Handoff
    ) -> None:
        self.step = step
        self.scheduler = scheduler
        self.handoff = handoff
        self.closed = False  # set by the engine's shutdown: `paused` restarts nothing after it
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def running(self) -> bool:
        """The thread is alive."""
        return self._thread is not None and self._thread.is_alive()

    def start(self) -> None:
        """Start the thread (a restart after a crash accepts requests again)."""
        if self.running:
            return
        self._stop.clear()
        self.scheduler.failure = None
        release_idle_team()  # the loop computes now: idle workers here would throttle its team
        self._thread = threading.Thread(target=self._run, name="astrai-engine", daemon=True)
        self._thread.start()

    def stop(self, timeout: float | None = 30.0) -> None:
        """Stop after the current step; queued and running tasks stay as they are."""
        self._stop.set()
        self.scheduler.wakeup.set()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None
        self.handoff.flush()

    def close(self) -> None:
        """Cancel every request, let the thread end them (a second at most), stop it, and
        restart nothing after (`closed`)."""
        self.closed = True
        self.scheduler.cancel_all()
        deadline = 50
        while self.running and self.scheduler.has_work() and deadline:
            threading.Event().wait(0.02)
            deadline -= 1
        self.stop()
        if self.scheduler.has_work():  # the thread was not running: clean up on this one
            self.scheduler.cleanup()

    def _run(self) -> None:
        logger.debug("engine loop started")
        wakeup = self.scheduler.wakeup
        while not self._stop.is_set():
            if not self.scheduler.has_work():
                self.handoff.flush()  # nothing follows to deliver what is held
                wakeup.wait(timeout=0.1)
                wakeup.clear()
                continue
            try:
                self.step()
            except Exception as err:
                logger.exception("engine loop crashed")
                self.scheduler.fail_all(f"{type(err).__name__}: {err}")
                return

    def halt(self) -> bool:
        """Stop the thread after the work it has; whether it was running."""
        was_running = self.running
        if was_running:
            while self.scheduler.has_work():
                threading.Event().wait(0.01)
                if not self.running:
                    break
            self.stop()
        return was_running

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """The thread stopped for the block (after finishing the work it has) and restarted
        after it, unless the engine was shut down meanwhile."""
        was_running = self.halt()
        try:
            yield
        finally:
            if was_running and not self.closed:
                self.start()

    def run_here(self, phases: list[Callable[[], None]]) -> None:
        """With the thread paused, for each phase: `queue()` it, then step on this thread
        until no work is left."""
        with self.paused():
            try:
                for queue in phases:
                    queue()
                    while self.scheduler.has_work():
                        self.step()
            finally:
                self.handoff.flush()


__all__ = ["EngineLoop"]
