"""`astrai.inference.loop.EngineLoop`: the background thread, paused for the caller."""

from __future__ import annotations

import threading

from astrai.inference.handoff import Handoff
from astrai.inference.loop import EngineLoop


class FakeScheduler:
    """Work is a counter of steps to run; `fail_all` records why."""

    def __init__(self, work: int = 0) -> None:
        self.work = work
        self.failure: str | None = None
        self.wakeup = threading.Event()
        self.cancelled = False

    def has_work(self) -> bool:
        return self.work > 0

    def fail_all(self, reason: str) -> None:
        self.failure = reason
        self.work = 0

    def cancel_all(self) -> None:
        self.cancelled = True
        self.wakeup.set()

    def cleanup(self) -> None:
        self.work = 0


def make(work: int = 0, step=None) -> tuple[EngineLoop, FakeScheduler, list[str]]:
    sched = FakeScheduler(work)
    threads: list[str] = []

    def default_step() -> None:
        threads.append(threading.current_thread().name)
        sched.work -= 1

    return EngineLoop(step or default_step, sched, Handoff(0.0)), sched, threads


def test_the_thread_runs_steps_while_there_is_work():
    loop, sched, threads = make(work=3)
    loop.start()
    try:
        for _ in range(500):
            if not sched.has_work():
                break
            threading.Event().wait(0.01)
        assert threads == ["astrai-engine"] * 3 and loop.running
    finally:
        loop.stop()
    assert not loop.running


def test_run_here_steps_on_the_calling_thread_and_restarts_the_loop():
    loop, sched, threads = make()
    loop.start()
    queued = []

    def queue(n: int):
        def add() -> None:
            queued.append(n)
            sched.work += n

        return add

    loop.run_here([queue(2), queue(1)])
    assert queued == [2, 1] and threads == [threading.current_thread().name] * 3
    assert loop.running  # restarted after the block
    loop.close()
    assert sched.cancelled and not loop.running
    with loop.paused():  # closed: nothing restarts it
        pass
    assert not loop.running


def test_a_crashing_step_fails_every_request_and_ends_the_thread():
    def boom() -> None:
        raise RuntimeError("boom")

    loop, sched, _ = make(work=1, step=boom)
    loop.start()
    for _ in range(500):
        if sched.failure is not None and not loop.running:
            break
        threading.Event().wait(0.01)
    assert sched.failure == "RuntimeError: boom" and not loop.running
