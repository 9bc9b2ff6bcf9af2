"""A hostile adapter hurts only its own requests, over HTTP (issue #44): a malformed or
non-finite adapter is a 400 naming the file (and the tensor) at `/v1/load_lora_adapter`, and
one line naming it at start-up (`lora_modules`, the CLI); a request whose adapter fails to
move into a device slot fails alone, while the other clients' requests are answered."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest
from hydra import compose, initialize_config_dir
from lora_helpers import make_adapter
from omegaconf import OmegaConf
from safetensors.torch import load_file, save_file
from serve_helpers import wait_idle

from astrai.inference import InferenceEngine
from astrai.model import AutoModel
from astrai.serve import ServerThread, ServeSettings, create_app
from astrai.serve.__main__ import serve

ROOT = Path(__file__).resolve().parents[2]
BASE = "base"
PROMPT = "def main(args):"

# adapter_config.json texts that are no config, and fields of a good one made malformed
MALFORMED = {
    "array": "[1, 2]",
    "string": '"lora"',
    "deep": "[" * 100_000 + "]" * 100_000,
}
BAD_FIELDS = {
    "alpha_str": {"lora_alpha": "x"},
    "alpha_huge": {"lora_alpha": 1e300},
    "r_str": {"r": "4"},
    "targets_int": {"target_modules": 5},
    "rslora_str": {"use_rslora": "yes"},
}


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    """The server's `allowed_lora_roots` (real path: the server names files by theirs)."""
    return Path(os.path.realpath(tmp_path_factory.mktemp("isolation")))


@pytest.fixture(scope="module")
def good(model_dir, root) -> dict[str, Path]:
    return {
        "a": make_adapter(model_dir, root / "a", r=4, seed=1),
        "b": make_adapter(model_dir, root / "b", r=4, seed=2),
    }


def malformed_dir(good_dir: Path, root: Path, case: str) -> Path:
    """A copy of `good_dir` whose config is the malformed `case` (MALFORMED or BAD_FIELDS)."""
    out = root / case
    shutil.copytree(good_dir, out)
    cfg = out / "adapter_config.json"
    if case in MALFORMED:
        cfg.write_text(MALFORMED[case])
    else:
        cfg.write_text(json.dumps({**json.loads(cfg.read_text()), **BAD_FIELDS[case]}))
    return out


@pytest.fixture(scope="module")
def lora_engine(model_dir, tokenizer, good):
    eng = InferenceEngine(
        AutoModel.from_pretrained(model_dir),
        tokenizer,
        max_batch_size=8,
        max_seq_len=256,
        cache_mode="contiguous",
        lora={"max_loras": 1, "max_lora_rank": 16},
    )
    for name, path in good.items():
        eng.load_adapter(name, path)
    yield eng
    eng.shutdown()


@pytest.fixture(scope="module")
def lora_server(lora_engine, root):
    settings = ServeSettings(
        model_name=BASE, allow_runtime_lora=True, allowed_lora_roots=(str(root),)
    )
    with ServerThread(create_app(lora_engine, settings)) as srv:
        yield srv


def load(server, name: str, path: Path) -> httpx.Response:
    body = {"lora_name": name, "lora_path": str(path)}
    return httpx.post(server.url + "/v1/load_lora_adapter", json=body, timeout=60)


@pytest.mark.parametrize("case", [*MALFORMED, *BAD_FIELDS])
def test_malformed_adapter_config_is_a_400_naming_the_file(
    lora_server, lora_engine, good, root, case
):
    path = malformed_dir(good["a"], root, case)
    r = load(lora_server, "bad", path)
    assert r.status_code == 400, r.text
    message = r.json()["error"]["message"]
    assert str(path / "adapter_config.json") in message
    assert "bad" not in [a.name for a in lora_engine.list_adapters()]
    assert httpx.get(lora_server.url + "/health").status_code == 200


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_non_finite_adapter_is_a_400_naming_the_tensor(lora_server, good, root, value):
    path = root / f"nonfinite-{value}"
    shutil.copytree(good["a"], path)
    tensors = load_file(path / "adapter_model.safetensors")
    key = sorted(tensors)[-1]
    tensors[key][-1, -1] = value
    save_file(tensors, path / "adapter_model.safetensors")
    r = load(lora_server, f"nonfinite-{value}", path)
    assert r.status_code == 400, r.text
    message = r.json()["error"]["message"]
    assert str(path / "adapter_model.safetensors") in message and key in message


@pytest.mark.slow  # a burst of concurrent requests on one slot
def test_a_failed_admission_fails_only_its_request(lora_server, lora_engine, monkeypatch):
    """`b`'s copy into the one device slot raises: `b`'s request gets an error, the base's
    and `a`'s get their greedy answers, and later requests are served."""
    client = openai.OpenAI(base_url=f"{lora_server.url}/v1", api_key="x", max_retries=0)

    def complete(model: str) -> str:
        r = client.completions.create(model=model, prompt=PROMPT, max_tokens=8, temperature=0)
        return r.choices[0].text

    wait_idle(lora_engine)
    want = {m: complete(m) for m in (BASE, "a")}

    def failing_copy():
        raise RuntimeError("injected slot copy failure")

    monkeypatch.setattr(lora_engine.adapters.by_name["b"], "weights", failing_copy)
    models = [BASE, "a", "b", BASE, "a"]
    with ThreadPoolExecutor(len(models)) as pool:
        futures = [pool.submit(complete, m) for m in models]
    for model, future in zip(models, futures):
        if model == "b":
            with pytest.raises(openai.InternalServerError, match="injected slot copy failure"):
                future.result()
        else:
            assert future.result() == want[model], model
    assert httpx.get(lora_server.url + "/health").status_code == 200
    assert {m: complete(m) for m in (BASE, "a")} == want
    monkeypatch.undo()
    assert complete("b") not in ("", None)


# ---------------------------------------------------------------------- start-up
def _cfg(overrides: list[str]) -> dict:
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose("serve", overrides=overrides)
    return OmegaConf.to_container(cfg, resolve=True)


@pytest.mark.parametrize("case", ["deep", "alpha_str", "alpha_huge"])
def test_malformed_startup_adapter_is_one_line(model_dir, good, tmp_path, monkeypatch, case):
    """`serve(cfg)` with a malformed `lora_modules` entry: a SystemExit of one line that
    names `lora_modules.<name>` and the file, before the app is built."""
    import astrai.runtime
    import astrai.serve

    monkeypatch.setattr(astrai.runtime, "set_threads", lambda threads: None)
    monkeypatch.setattr(astrai.serve, "create_app", lambda *a, **k: pytest.fail("app built"))
    path = malformed_dir(good["a"], tmp_path, case)
    cfg = _cfg(
        [
            f"model_path={model_dir}",
            "port=0",
            "engine=contiguous",
            "engine.max_batch_size=2",
            "engine.max_seq_len=128",
            f"lora_modules={{bad: '{path}'}}",
        ]
    )
    with pytest.raises(SystemExit) as err:
        serve(cfg)
    message = str(err.value)
    assert message.startswith(f"lora_modules.bad: {path / 'adapter_config.json'}: ")
    assert "\n" not in message


@pytest.mark.slow  # a subprocess importing torch
def test_serve_command_names_a_malformed_adapter_in_one_line(model_dir, good, tmp_path):
    path = malformed_dir(good["a"], tmp_path, "deep")
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "astrai.serve",
            f"model_path={model_dir}",
            "port=0",
            "engine=contiguous",
            "engine.max_batch_size=2",
            "engine.max_seq_len=128",
            f"lora_modules={{bad: '{path}'}}",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode != 0
    assert "Traceback" not in proc.stderr, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if "lora_modules.bad" in line]
    assert lines == [
        f"lora_modules.bad: {path / 'adapter_config.json'}: not valid JSON (nested too deeply)"
    ], proc.stderr
