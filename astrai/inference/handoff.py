"""Hand-off of streamed text from the engine's loop thread to asyncio event loops.

Every token of every streaming request used to wake its event loop on its own
(`call_soon_threadsafe` per token: a self-pipe write and a thread wake-up each). With a
batch of 48 requests that is 48 wake-ups per step, and on a 2-core machine the event
loop's thread then competes with the model for the cores. `Handoff` collects what a step
produces and delivers it with one wake-up per event loop per step; outside a step (a
subscriber catching up, a cancellation from the event loop) items go at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Callable
from typing import Any

Delivery = tuple[Callable[..., Any], tuple[Any, ...]]


def _deliver(items: list[Delivery]) -> None:
    for fn, args in items:
        fn(*args)


class Handoff:
    """Per-step batching of `loop.call_soon_threadsafe` calls, owned by one engine.

    The engine brackets each step with `begin_step` / `end_step`; `post` may be called from
    any thread. Items for one event loop keep their order: deferred and immediate posts are
    both handed to the loop under one lock.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._depth = 0
        self._pending: dict[asyncio.AbstractEventLoop, list[Delivery]] = {}

    def post(self, loop: asyncio.AbstractEventLoop, fn: Callable[..., Any], *args: Any) -> None:
        """Run `fn(*args)` on `loop`: at the end of the current step, or now outside one."""
        with self._lock:
            if self._depth:
                self._pending.setdefault(loop, []).append((fn, args))
            else:
                _call_soon(loop, [(fn, args)])

    def begin_step(self) -> None:
        with self._lock:
            self._depth += 1

    def end_step(self) -> None:
        """Deliver what the step posted: one wake-up per event loop."""
        with self._lock:
            self._depth -= 1
            if self._depth or not self._pending:
                return
            pending, self._pending = self._pending, {}
            for loop, items in pending.items():
                _call_soon(loop, items)


def _call_soon(loop: asyncio.AbstractEventLoop, items: list[Delivery]) -> None:
    with contextlib.suppress(RuntimeError):  # a closed loop: nobody is listening any more
        loop.call_soon_threadsafe(_deliver, items)
