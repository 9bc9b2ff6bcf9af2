"""Helpers for tests that start `python -m astrai.serve` in a subprocess: a free port, the
wait for `/health`, and a stop that never leaves the process behind."""

from __future__ import annotations

import signal
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


def stop(proc: subprocess.Popen, sig: int = signal.SIGINT, timeout: float = 30) -> int:
    """Send `sig` and wait for the exit (killed after `timeout`); its return code."""
    proc.send_signal(sig)
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        return proc.wait()
