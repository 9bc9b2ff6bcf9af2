"""`python -m astrai.serve lora_modules=...`: adapters loaded at startup through the Hydra
entry, and a bad adapter directory stopping the server before it listens."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from hydra import compose, initialize_config_dir
from lora_helpers import make_adapter
from omegaconf import OmegaConf
from server_process import free_port, wait_healthy

from astrai.serve.__main__ import engine_options, lora_modules_of, serve

ROOT = Path(__file__).resolve().parents[2]


def _cfg(overrides: list[str]) -> dict:
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose("serve", overrides=overrides)
    out = OmegaConf.to_container(cfg, resolve=True)
    assert isinstance(out, dict)
    return out


@pytest.fixture
def in_process(monkeypatch):
    """`serve(cfg)` run here: keep this process's torch threads and root log level."""
    import logging

    import astrai.runtime

    monkeypatch.setattr(astrai.runtime, "set_threads", lambda threads: None)
    root = logging.getLogger()
    level = root.level
    yield
    root.setLevel(level)


@pytest.fixture(scope="module")
def adapter_dir(model_dir, tmp_path_factory) -> Path:
    return make_adapter(model_dir, tmp_path_factory.mktemp("cli-adapter") / "a", r=4, seed=5)


def test_lora_modules_is_a_serve_key(adapter_dir):
    assert _cfg([])["lora_modules"] is None
    as_map = _cfg([f"lora_modules={{a: '{adapter_dir}'}}"])
    assert lora_modules_of(as_map) == {"a": str(adapter_dir)}
    as_list = _cfg([f"lora_modules=['a={adapter_dir}']"])  # vLLM's spelling
    assert lora_modules_of(as_list) == {"a": str(adapter_dir)}
    # LoRA is turned on with the default limits, unless engine.lora says otherwise
    assert engine_options(as_map)["lora"] == {}
    assert engine_options(_cfg([])).get("lora") is None  # conf/engine: lora: null
    limits = {**as_map, "engine": {**as_map["engine"], "lora": {"max_loras": 2}}}
    assert engine_options(limits)["lora"] == {"max_loras": 2}


@pytest.mark.parametrize(
    ("given", "named"),
    [
        (["a"], "lora_modules: expected name=path"),
        ("a", "lora_modules: expected a mapping"),
        ({"a": None}, "lora_modules.a"),
    ],
)
def test_malformed_lora_modules_name_the_key(given, named):
    with pytest.raises(SystemExit, match=named):
        lora_modules_of({"lora_modules": given})


def test_missing_adapter_dir_fails_before_the_model_loads(
    model_dir, tmp_path, monkeypatch, in_process
):
    import astrai.serve.__main__ as main

    monkeypatch.setattr(main, "build_engine", lambda cfg: pytest.fail("the model was loaded"))
    missing = tmp_path / "nope"
    cfg = _cfg([f"model_path={model_dir}", "port=0", f"lora_modules={{a: '{missing}'}}"])
    with pytest.raises(SystemExit, match=f"lora_modules.a: {missing} is not a directory"):
        serve(cfg)


def test_bad_adapter_fails_before_the_server_starts(model_dir, tmp_path, monkeypatch, in_process):
    import astrai.serve

    def never(*args, **kwargs):
        pytest.fail("the app was built")

    monkeypatch.setattr(astrai.serve, "create_app", never)
    empty = tmp_path / "empty"
    empty.mkdir()
    cfg = _cfg(
        [
            f"model_path={model_dir}",
            "port=0",
            "engine=contiguous",
            "engine.max_batch_size=2",
            "engine.max_seq_len=128",
            f"lora_modules={{a: '{empty}'}}",
        ]
    )
    with pytest.raises(SystemExit) as err:
        serve(cfg)
    message = str(err.value)
    assert message.startswith("lora_modules.a: ")
    assert str(empty / "adapter_config.json") in message


@pytest.mark.slow  # a subprocess importing torch
def test_serve_command_with_lora_modules(model_dir, adapter_dir):
    port = free_port()
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "astrai.serve",
            f"model_path={model_dir}",
            f"port={port}",
            "model_name=base",
            "engine=contiguous",
            "engine.max_batch_size=4",
            "engine.max_seq_len=256",
            f"lora_modules={{a: '{adapter_dir}'}}",
        ],
        cwd=ROOT,
        env={**os.environ},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        url = f"http://127.0.0.1:{port}"
        wait_healthy(proc, url, 120)
        cards = {m["id"]: m for m in httpx.get(url + "/v1/models").json()["data"]}
        assert cards["a"]["parent"] == "base" and cards["base"]["parent"] is None
        body = {"model": "a", "prompt": "def f(x):", "max_tokens": 4, "temperature": 0}
        r = httpx.post(url + "/v1/completions", json=body, timeout=60)
        assert r.status_code == 200 and r.json()["model"] == "a"
        r = httpx.post(url + "/v1/completions", json={**body, "model": "b"}, timeout=60)
        assert r.status_code == 404
    finally:
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0, out
    assert "LoRA adapter a" in out
