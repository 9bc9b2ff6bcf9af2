"""A new user's serve commands (#17): a busy port fails before the model loads, naming
`port`; `model.path=` (training's key) is answered with `model_path=`; the name a response
carries is the id that `/v1/models` lists (checked with the openai and anthropic SDKs).
Part 2 (#44, #54): a reward model given as `model_path` names `reward_model=`; a policy and
a reward model both exported to `export` folders get distinct ids; the start-up line says
what `auto` resolved to and whether speculation is on; `"model": null` is the base model."""

import shutil
import socket
import subprocess
import sys
from pathlib import Path
from typing import ClassVar

import anthropic
import httpx
import openai
import pytest
from serve_helpers import serve_config

from astrai.serve import ServerThread, ServeSettings, create_app

ROOT = Path(__file__).resolve().parents[2]
CHAT = [{"role": "user", "content": "What is 2 + 3?"}]


def _serve(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "astrai.serve", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.mark.slow  # a subprocess importing hydra: a few seconds
def test_busy_port_fails_before_the_model_loads(model_dir):
    with socket.socket() as holder:  # a server already on the port
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        p = _serve(f"model_path={model_dir}", f"port={port}")
    log = p.stdout + p.stderr
    assert p.returncode != 0
    assert f"port={port}" in log and "in use" in log, log[-2000:]
    # nothing expensive ran first: no thread choice (torch import), no model, no KV cache
    for later in ("torch threads", "KV cache", "serving "):
        assert later not in log, log[-2000:]


@pytest.mark.parametrize("key", ["model.path", "model", "model_dir"])
def test_model_directory_key_is_named(key, tmp_path):
    p = _serve(f"{key}={tmp_path}", timeout=60)
    assert p.returncode != 0
    assert f"model_path={tmp_path}" in p.stderr, p.stderr[-2000:]
    assert "Traceback" not in p.stderr and "not in struct" not in p.stderr


@pytest.fixture(scope="module")
def named_server(engine):
    with ServerThread(create_app(engine, ServeSettings(model_name="tiny-export"))) as srv:
        yield srv


def test_responses_carry_the_listed_model_name(named_server):
    with openai.OpenAI(
        base_url=f"{named_server.url}/v1", api_key="x", max_retries=0, timeout=60
    ) as oai:
        listed = [m.id for m in oai.models.list()]
        assert listed == ["tiny-export"]
        # whatever the client asks for, the answer names the model that served it
        for asked in ("tiny-export", "gpt-4o", "astrai"):
            chat = oai.chat.completions.create(model=asked, messages=CHAT, max_tokens=3)
            assert chat.model == listed[0]
            text = oai.completions.create(model=asked, prompt="2 + 3 =", max_tokens=3)
            assert text.model == listed[0]
        stream = oai.chat.completions.create(
            model="other", messages=CHAT, max_tokens=3, stream=True
        )
        assert {chunk.model for chunk in stream} == {listed[0]}
    with anthropic.Anthropic(
        base_url=named_server.url, api_key="x", max_retries=0, timeout=60
    ) as ant:
        message = ant.messages.create(model="claude-x", messages=CHAT, max_tokens=3)
        assert message.model == listed[0]
        events = list(
            ant.messages.create(model="claude-x", messages=CHAT, max_tokens=3, stream=True)
        )
        starts = [e.message.model for e in events if e.type == "message_start"]
        assert starts == [listed[0]]


# ---------------------------------------------------------------------- #44 / #54
@pytest.fixture(scope="module")
def exports(model_dir, tmp_path_factory):
    """A generative export and a reward model's, each in a folder named `export` (what
    `make train` writes), as after `+experiment=tiny_reward`."""
    import torch

    from astrai.model import load_pretrained
    from astrai.model.reward import RewardModel, save_reward_model
    from astrai.tokenizer import AutoTokenizer

    root = tmp_path_factory.mktemp("exports")
    policy = shutil.copytree(model_dir, root / "policy" / "export")
    torch.manual_seed(0)
    reward = RewardModel.from_backbone(load_pretrained(model_dir, dtype=torch.float32))
    tok = AutoTokenizer.from_pretrained(model_dir)
    return policy, save_reward_model(reward, root / "reward" / "export", tokenizer=tok)


class _Served:
    """Stands in for uvicorn's `Server` in `serve(cfg)`: `run()` asks the app what a client
    would (through Starlette's test client), then returns as after Ctrl-C."""

    seen: ClassVar[dict] = {}

    def __init__(self, config) -> None:
        self.app = config.app

    def run(self) -> None:
        import llguidance
        from fastapi.testclient import TestClient

        seen = type(self).seen
        seen["built_before_requests"] = len(llguidance.LLTokenizer.built)
        with TestClient(self.app) as client:
            seen["models"] = client.get("/v1/models").json()
            body = {
                "messages": CHAT,
                "max_tokens": 4,
                "response_format": {"type": "json_object"},
            }
            seen["structured"] = client.post("/v1/chat/completions", json=body).status_code


def test_a_reward_model_as_model_path_names_the_flag(exports, monkeypatch, in_process):
    import astrai.serve.__main__ as main

    _, reward = exports
    for heavy in ("build_engine", "build_reward"):
        monkeypatch.setattr(main, heavy, lambda *a, **k: pytest.fail("a model was loaded"))
    with pytest.raises(SystemExit) as err:
        main.serve(serve_config([f"model_path={reward}", "port=0"]))
    message = str(err.value)
    assert message.startswith(f"model_path={reward}: a reward model (")
    assert f"reward_model={reward}" in message and "\n" not in message


def test_policy_and_reward_exports_get_distinct_ids_and_the_start_up_line(
    exports, monkeypatch, in_process, caplog
):
    """Both folders are named `export`: `/v1/models` lists `export` and `export-reward`,
    and `/v1/score` answers to the latter. The start-up line names what `auto` resolved to
    and the speculative setting; llguidance's tokenizer is built before serving."""
    import logging

    import llguidance

    import astrai.serve
    import astrai.serve.__main__ as main

    policy, reward = exports
    monkeypatch.setattr(astrai.serve, "Server", _Served)
    make = llguidance.LLTokenizer

    def counting(*args, **kwargs):
        counting.built.append(1)
        return make(*args, **kwargs)

    counting.built = []
    monkeypatch.setattr(llguidance, "LLTokenizer", counting)
    caplog.set_level(logging.INFO, logger="astrai.serve")
    cfg = serve_config(
        [
            f"model_path={policy}",
            f"reward_model={reward}",
            "port=0",
            "device=cpu",
            "engine=contiguous",
            "engine.max_batch_size=2",
            "engine.max_seq_len=128",
            "engine.speculative={method: ngram, num_speculative_tokens: 3}",
            "tool_parser=auto",
            "reasoning_parser=auto",
        ]
    )
    main.serve(cfg)
    seen = _Served.seen
    ids = [m["id"] for m in seen["models"]["data"]]
    assert ids == ["export", "export-reward"]
    # llguidance's tokenizer: built once, at start-up; the structured request found it
    assert seen["built_before_requests"] == 1 and seen["structured"] == 200
    assert counting.built == [1]
    line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("serving "))
    assert "tool parser hermes (auto)" in line, line
    assert "reasoning parser none (auto)" in line, line
    assert "speculative decoding ngram, up to 3 tokens per step" in line, line


def test_reward_model_name_may_not_take_the_served_name(exports, no_model_load):
    policy, reward = exports
    cfg = [f"model_path={policy}", f"reward_model={reward}", "reward_model_name=export"]
    with pytest.raises(SystemExit, match=r"^reward_model_name=export: the served model's own"):
        no_model_load(serve_config(cfg))


@pytest.fixture
def no_model_load(monkeypatch, in_process):
    import astrai.serve.__main__ as main

    monkeypatch.setattr(main, "build_engine", lambda cfg: pytest.fail("the model was loaded"))
    monkeypatch.setattr(main, "build_reward", lambda *a: pytest.fail("the model was loaded"))
    return main.serve


@pytest.fixture(scope="module")
def null_model_server(engine, exports):
    from astrai.serve.score import RewardScorer

    scorer = RewardScorer.from_pretrained(exports[1], name="rm")
    with ServerThread(create_app(engine, ServeSettings(model_name="base"), reward=scorer)) as srv:
        yield srv


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/chat/completions", {"messages": CHAT, "max_tokens": 2}),
        ("/v1/completions", {"prompt": "2 + 3 =", "max_tokens": 2}),
        ("/v1/messages", {"messages": CHAT, "max_tokens": 2}),
        ("/v1/messages/count_tokens", {"messages": CHAT}),
        ("/v1/score", {"text_1": "2 + 3?", "text_2": ["5", "6"]}),
    ],
)
def test_model_null_means_the_base_model(null_model_server, path, body):
    """vLLM reads `"model": null` as the served model; every route that takes `model`."""
    r = httpx.post(null_model_server.url + path, json={"model": None, **body}, timeout=60)
    assert r.status_code == 200, r.text
    if "model" in r.json():
        assert r.json()["model"] == ("rm" if path == "/v1/score" else "base")
