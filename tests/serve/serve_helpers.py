"""Helpers for tests that start `python -m astrai.serve` in a subprocess."""

from __future__ import annotations

import socket
import subprocess
import time

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(proc: subprocess.Popen, url: str, timeout: float) -> None:
    """Poll `url`/health until it answers 200; fail if the process dies or time runs out."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            if httpx.get(url + "/health").status_code == 200:
                return
        except httpx.TransportError:
            pass
        assert proc.poll() is None and time.monotonic() < deadline, "server did not start"
        time.sleep(0.2)


def wait_idle(engine, timeout: float = 30.0) -> None:
    """Until no task runs or waits and every KV page is free: the engine loop releases a
    finished request right after its step, possibly after its client got the answer."""
    deadline = time.monotonic() + timeout
    while True:
        s = engine.get_stats()
        if s["active_tasks"] == 0 and s["waiting_queue"] == 0 and engine.pool.all_free():
            return
        assert time.monotonic() < deadline, f"engine not idle after {timeout} s: {s}"
        time.sleep(0.005)
