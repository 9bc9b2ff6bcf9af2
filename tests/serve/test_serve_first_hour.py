"""A new user's serve commands (#17): a busy port fails before the model loads, naming
`port`; `model.path=` (training's key) is answered with `model_path=`; the name a response
carries is the id that `/v1/models` lists (checked with the openai and anthropic SDKs)."""

import socket
import subprocess
import sys
from pathlib import Path

import anthropic
import openai
import pytest

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
