"""`python -m astrai.serve`: a clear error without a model; a real server with one."""

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow  # a subprocess importing torch: ~10 s on a loaded machine
def test_missing_model_names_the_path(tmp_path):
    missing = tmp_path / "nope"
    p = subprocess.run(
        [sys.executable, "-m", "astrai.serve", f"model={missing}"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.returncode != 0
    assert str(missing) in p.stderr and "make train" in p.stderr


@pytest.mark.slow
def test_serve_command(model_dir):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "ASTRAI_MODEL": str(model_dir)}  # the default model path
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "astrai.serve",
            f"port={port}",
            "cache_mode=paged",
            "kv_tokens=4096",
        ],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 120
        while True:
            try:
                if httpx.get(url + "/health").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert proc.poll() is None and time.monotonic() < deadline, "server did not start"
            time.sleep(0.2)
        models = httpx.get(url + "/v1/models").json()
        assert models["data"][0]["id"] == model_dir.name
        body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
        r = httpx.post(url + "/v1/chat/completions", json=body, timeout=60)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1
    finally:
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0, out
    log = [line for line in out.splitlines() if "tokens_in=" in line]
    assert len(log) == 1 and "ttft=" in log[0] and "duration=" in log[0], out
