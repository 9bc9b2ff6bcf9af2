"""Helpers for the tests that launch `python -m astrai.serve replicas=N` (test_replicas.py,
test_router.py): a block of free ports, the launch with its output in a file, and a wait for
a line of that output."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[2]


def free_port_block(n: int) -> int:
    """A first port p such that p .. p+n-1 are all free now."""
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            base = s.getsockname()[1]
        if base + n > 65535:
            continue
        socks = []
        try:
            for port in range(base, base + n):
                sock = socket.socket()
                socks.append(sock)
                sock.bind(("127.0.0.1", port))
            return base
        except OSError:
            continue
        finally:
            for sock in socks:
                sock.close()


def launch(model_dir: Path, port: int, log: Path, *extra: str) -> subprocess.Popen:
    """`python -m astrai.serve replicas=2` on the tiny model, one torch thread each; the
    launcher's and the children's output go to `log`."""
    cmd = [sys.executable, "-m", "astrai.serve", f"model_path={model_dir}", f"port={port}"]
    cmd += ["replicas=2", "threads=1", "device=cpu", "engine.max_batch_size=8", *extra]
    with open(log, "w") as out:
        return subprocess.Popen(
            cmd,
            cwd=ROOT,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
            stdout=out,
            stderr=subprocess.STDOUT,
        )


def wait_for_line(proc: subprocess.Popen, log: Path, pattern: str) -> re.Match:
    """The first match of `pattern` in `log`; fails if the launcher exits before it."""
    while True:
        m = re.search(pattern, log.read_text(errors="replace"))
        if m:
            return m
        assert proc.poll() is None, f"launcher exited ({proc.returncode}):\n{log.read_text()}"
        time.sleep(0.2)


def refused(url: str) -> bool:
    """True when nothing listens at `url` any more."""
    try:
        httpx.get(url + "/health", timeout=2)
    except httpx.TransportError:
        return True
    return False


def stop(proc: subprocess.Popen) -> None:
    """Kill a launcher a failed test left running (its children stop with it: they are
    sent SIGTERM from its `finally`; a SIGKILL leaves them, so SIGTERM first)."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=90)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
