"""`python -m astrai.serve`: a clear error without a model; a real server with one; the
engine settings come from the shared `engine` config group."""

import functools
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from hydra import compose, initialize_config_dir
from hydra.errors import ConfigCompositionException
from hydra.utils import instantiate
from serve_helpers import serve_config
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


class Reached(Exception):
    """Raised by the patched `build_engine`: every start-up check has passed."""


@pytest.fixture
def no_model(monkeypatch, in_process):
    """`serve(cfg)` stops where the model would load (raising `Reached`)."""
    import astrai.serve.__main__ as main

    def reached(cfg):
        raise Reached

    monkeypatch.setattr(main, "build_engine", reached)
    return main.serve


@pytest.mark.parametrize(
    ("overrides", "named"),
    [
        (["max_body_bytes=0"], "max_body_bytes: must be a positive int"),
        (["max_body_bytes=-5"], "max_body_bytes: must be a positive int"),
        (["max_prompt_chars=-1"], "max_prompt_chars: must be an int >= 0 or null"),
        (["request_timeout_s=0"], "request_timeout_s: must be a positive number"),
        (["request_timeout_s=-1.5"], "request_timeout_s: must be a positive number"),
        (["port=abc"], r"port: must be an int in \[0, 65535\], got 'abc'"),
        (["port=70000"], r"port: must be an int in \[0, 65535\]"),
        (["engine.lora={max_loras: 0}"], "engine.lora.max_loras must be a positive int"),
        (["engine.lora={rank: 8}"], r"engine.lora: unknown key\(s\) \['rank'\]"),
        (["engine.speculative={method: eagle}"], "engine.speculative.method must be one of"),
        (
            ["engine.speculative={num_speculative_tokens: 0}"],
            "engine.speculative.num_speculative_tokens must be an int",
        ),
        (
            ["engine.speculative={method: draft_model, model: /no/such/draft}"],
            "engine.speculative.model=/no/such/draft: model directory not found",
        ),
    ],
)
def test_settings_that_would_fail_every_request_are_refused_at_start_up(
    model_dir, no_model, overrides, named
):
    with pytest.raises(SystemExit) as err:
        no_model(serve_config([f"model_path={model_dir}", "port=0", *overrides]))
    message = str(err.value)
    assert re.match(named, message), message
    assert "\n" not in message


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "192.168.1.20", "example.org"])
def test_a_non_loopback_host_needs_a_key_or_an_explicit_yes(model_dir, no_model, host):
    base = [f"model_path={model_dir}", "port=0", f"host='{host}'", "api_key=null"]
    with pytest.raises(SystemExit) as err:
        no_model(serve_config(base))
    message = str(err.value)
    assert message.startswith(f"host={host}: reachable from other machines"), message
    assert "api_key=<key>" in message and "allow_unauthenticated=true" in message


@pytest.mark.parametrize(
    "overrides",
    [
        ["host=127.0.0.1"],
        ["host=localhost"],
        ["host='::1'"],
        ["host=0.0.0.0", "api_key=sesame"],
        ["host=0.0.0.0", "allow_unauthenticated=true"],
    ],
)
def test_loopback_a_key_or_an_explicit_yes_pass(model_dir, no_model, overrides):
    with pytest.raises(Reached):
        no_model(serve_config([f"model_path={model_dir}", "port=0", "api_key=null", *overrides]))


@pytest.mark.slow  # subprocesses importing hydra
@pytest.mark.parametrize(
    ("args", "line"),
    [
        (["port=abc"], "port: must be an int in [0, 65535], got 'abc'"),
        (["host=0.0.0.0", "api_key=null"], "host=0.0.0.0: reachable from other machines"),
    ],
)
def test_bad_address_is_one_line(model_dir, args, line):
    p = subprocess.run(
        [sys.executable, "-m", "astrai.serve", f"model_path={model_dir}", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.returncode != 0
    assert p.stderr.strip() == line or p.stderr.strip().startswith(line), p.stderr[-2000:]
    assert "Traceback" not in p.stderr and len(p.stderr.strip().splitlines()) == 1
