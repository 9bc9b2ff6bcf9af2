"""`python -m astrai.serve`: a clear error without a model; a real server with one; the
engine settings come from the shared `engine` config group."""

import functools
import os
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from hydra import compose, initialize_config_dir
from hydra.errors import ConfigCompositionException
from hydra.utils import instantiate
from server_process import free_port, wait_healthy

from astrai.inference import InferenceEngine

ROOT = Path(__file__).resolve().parents[2]


def _compose(name, overrides=()):
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        return compose(name, overrides=list(overrides))


@pytest.mark.parametrize("command", ["serve", "generate"])
def test_engine_group_builds_the_engine(command):
    cfg = _compose(
        command, ["model_path=/m", "input=i", "output=o"][: 1 if command == "serve" else 3]
    )
    assert cfg.engine.cache_mode == "paged" and cfg.engine.page_size == 16
    factory = instantiate(cfg.engine)
    assert isinstance(factory, functools.partial) and factory.func is InferenceEngine
    assert factory.keywords["max_batch_size"] == 32
    cfg = _compose(
        command, ["engine=contiguous", "engine.page_size=32", "engine.max_batch_size=64"]
    )
    assert (cfg.engine.cache_mode, cfg.engine.page_size, cfg.engine.max_batch_size) == (
        "contiguous",
        32,
        64,
    )


def test_serve_keeps_its_own_engine_settings():
    # serve bounds its queue (503 + retry-after), whichever cache mode is chosen
    assert _compose("serve").engine.max_queue == 256
    assert _compose("serve", ["engine=contiguous"]).engine.max_queue == 256
    assert _compose("generate", ["input=i", "output=o"]).engine.max_queue is None


def test_engine_defaults_live_once():
    """Engine defaults are written in conf/engine/ only. Callers override sizes (batch,
    context, KV budget, queue, cache mode) for their own needs, never these."""
    once = ("page_size", "prefix_cache", "max_prefill_tokens", "decode_graphs", "memory_fraction")
    for path in (ROOT / "conf").rglob("*.yaml"):
        if path.parent.name != "engine":
            for key in once:
                assert f"{key}:" not in path.read_text(), f"{path} repeats engine.{key}"


def test_model_is_not_a_serve_key():
    """`model` is the training config group in conf/: the model directory is `model_path`."""
    with pytest.raises(ConfigCompositionException, match="model"):
        _compose("serve", ["model=/some/dir"])


@pytest.mark.slow  # a subprocess importing torch: ~10 s on a loaded machine
def test_missing_model_names_the_path(tmp_path):
    missing = tmp_path / "nope"
    p = subprocess.run(
        [sys.executable, "-m", "astrai.serve", f"model_path={missing}"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.returncode != 0
    assert str(missing) in p.stderr and "make train" in p.stderr


@pytest.mark.slow
def test_serve_command(model_dir):
    port = free_port()
    env = {**os.environ, "ASTRAI_MODEL": str(model_dir)}  # the default model path
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "astrai.serve",
            f"port={port}",
            "engine=paged",
            "engine.kv_tokens=4096",
            "engine.max_batch_size=4",
        ],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        url = f"http://127.0.0.1:{port}"
        wait_healthy(proc, url, 120)
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
