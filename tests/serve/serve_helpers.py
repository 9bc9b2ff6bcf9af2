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
