"""`python -m astrai.serve lora_modules=...`: adapters loaded at startup through the Hydra
entry, and a bad adapter directory or name stopping the server before it listens; runtime
loading only with `allow_runtime_lora=true` and `allowed_lora_roots`."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from lora_helpers import make_adapter
from serve_helpers import serve_config
from server_process import free_port, wait_healthy

from astrai.serve.__main__ import engine_options, lora_modules_of, serve

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def adapter_dir(model_dir, tmp_path_factory) -> Path:
    return make_adapter(model_dir, tmp_path_factory.mktemp("cli-adapter") / "a", r=4, seed=5)


def test_lora_modules_is_a_serve_key(adapter_dir):
    assert serve_config([])["lora_modules"] is None
    as_map = serve_config([f"lora_modules={{a: '{adapter_dir}'}}"])
    assert lora_modules_of(as_map) == {"a": str(adapter_dir)}
    as_list = serve_config([f"lora_modules=['a={adapter_dir}']"])  # vLLM's spelling
    assert lora_modules_of(as_list) == {"a": str(adapter_dir)}
    # LoRA is turned on with the default limits, unless engine.lora says otherwise
    assert engine_options(as_map)["lora"] == {}
    assert engine_options(serve_config([])).get("lora") is None  # conf/engine: lora: null
    limits = {**as_map, "engine": {**as_map["engine"], "lora": {"max_loras": 2}}}
    assert engine_options(limits)["lora"] == {"max_loras": 2}


@pytest.mark.parametrize(
    ("given", "named"),
    [
        (["a"], "lora_modules: expected name=path"),
        ("a", "lora_modules: expected a mapping"),
        ({"a": None}, "lora_modules.a"),
        ({"a/b": "/x"}, "lora_modules.a/b: a name, not a path"),
        ({"x" * 129: "/x"}, "at most 128 characters"),
        ({"bad\x1b[31m": "/x"}, "unprintable"),
        ({"policy": "/x"}, "live adapter"),
        (["../up=/x"], r"lora_modules\.\.\./up: a name, not a path"),
    ],
)
def test_malformed_lora_modules_name_the_key(given, named):
    with pytest.raises(SystemExit, match=named):
        lora_modules_of({"lora_modules": given})


@pytest.mark.parametrize(
    ("overrides", "named"),
    [
        (["allow_runtime_lora=true"], "allowed_lora_roots: allow_runtime_lora=true needs"),
        (["allow_runtime_lora=true", "allowed_lora_roots=[/no/such/dir]"], "is not a directory"),
        (["allow_runtime_lora=yes"], "allow_runtime_lora: must be true or false"),
        (["lora_modules={model: /tmp}", "model_name=model"], "lora_modules.model: the name of"),
    ],
)
def test_runtime_lora_settings_fail_before_the_model_loads(
    model_dir, monkeypatch, in_process, overrides, named
):
    import astrai.serve.__main__ as main

    monkeypatch.setattr(main, "build_engine", lambda cfg: pytest.fail("the model was loaded"))
    cfg = serve_config([f"model_path={model_dir}", "port=0", *overrides])
    with pytest.raises(SystemExit, match=named):
        serve(cfg)


def test_runtime_lora_turns_lora_on(model_dir, tmp_path):
    cfg = serve_config(["allow_runtime_lora=true", f"allowed_lora_roots=[{tmp_path}]"])
    assert engine_options(cfg)["lora"] == {}
    assert engine_options(serve_config([])).get("lora") is None


def test_missing_adapter_dir_fails_before_the_model_loads(
    model_dir, tmp_path, monkeypatch, in_process
):
    import astrai.serve.__main__ as main

    monkeypatch.setattr(main, "build_engine", lambda cfg: pytest.fail("the model was loaded"))
    missing = tmp_path / "nope"
    cfg = serve_config([f"model_path={model_dir}", "port=0", f"lora_modules={{a: '{missing}'}}"])
    with pytest.raises(SystemExit, match=f"lora_modules.a: {missing} is not a directory"):
        serve(cfg)


def test_bad_adapter_fails_before_the_server_starts(model_dir, tmp_path, monkeypatch, in_process):
    import astrai.serve

    def never(*args, **kwargs):
        pytest.fail("the app was built")

    monkeypatch.setattr(astrai.serve, "create_app", never)
    empty = tmp_path / "empty"
    empty.mkdir()
    cfg = serve_config(
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
def test_serve_command_with_lora_modules(model_dir, adapter_dir, tmp_path):
    """The issue's reproduction: `/etc` is no existence oracle any more, and the operator's
    adapter `a` cannot be unloaded (so not replaced) by a client."""
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
            "allow_runtime_lora=true",
            f"allowed_lora_roots=[{adapter_dir.parent}]",
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
        load = url + "/v1/load_lora_adapter"
        for outside in ("/etc", "/no/such/dir"):
            r = httpx.post(load, json={"lora_name": "t", "lora_path": outside})
            assert r.status_code == 400 and r.json()["error"]["code"] == "lora_path_not_allowed"
            assert "adapter_config.json" not in r.text
        r = httpx.post(url + "/v1/unload_lora_adapter", json={"lora_name": "a"})
        assert r.status_code == 400 and r.json()["error"]["code"] == "adapter_pinned"
        r = httpx.post(load, json={"lora_name": "b", "lora_path": adapter_dir.name})
        assert r.status_code == 200, r.text
        assert "/" not in str([m["root"] for m in httpx.get(url + "/v1/models").json()["data"]])
    finally:
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0, out
    assert "LoRA adapter a" in out
    assert f"runtime LoRA loading from {adapter_dir.parent}" in out
