"""Access log and request ids: one INFO line per API request on `astrai.serve.access`, with
its fields; `X-Request-Id` echoed (the client's, or a new one) on every response."""

from __future__ import annotations

import logging
import re
import shlex
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import openai
import pytest
from server_process import free_port, wait_healthy

from astrai.serve import ServerThread, ServeSettings, create_app

MSGS = [{"role": "user", "content": "hello there"}]
CHAT = "/v1/chat/completions"
ACCESS = "astrai.serve.access"
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def log_server(engine):
    with ServerThread(create_app(engine, ServeSettings(max_body_bytes=4096))) as srv:
        yield srv


@pytest.fixture
def access(caplog):
    """`access()` -> the access log records so far, as (fields dict, message)."""
    caplog.set_level(logging.DEBUG, logger=ACCESS)

    def records(level: int = logging.INFO) -> list[tuple[dict, str]]:
        return [
            (r.access, r.getMessage())
            for r in caplog.records
            if r.name == ACCESS and r.levelno == level
        ]

    return records


def parse_logfmt(line: str) -> dict[str, str]:
    return dict(part.split("=", 1) for part in shlex.split(line))


def test_chat_request_logs_one_line_with_its_fields(log_server, access):
    with openai.OpenAI(
        base_url=f"{log_server.url}/v1", api_key="x", max_retries=0, timeout=60
    ) as oai:
        raw = oai.chat.completions.with_raw_response.create(
            model="astrai",
            messages=MSGS,
            max_tokens=5,
            extra_headers={"X-Request-Id": "trace-42"},
        )
    r = raw.parse()
    assert raw.headers["x-request-id"] == "trace-42"
    assert r.id.startswith("chatcmpl-")  # the response id keeps its own format
    lines = access()
    assert len(lines) == 1
    fields, message = lines[0]
    parsed = parse_logfmt(message)
    assert parsed == {
        k: (f"{v:.3f}" if isinstance(v, float) else str(v)) for k, v in fields.items()
    }
    assert parsed["request_id"] == "trace-42"
    assert parsed["method"] == "POST" and parsed["path"] == CHAT and parsed["status"] == "200"
    assert parsed["protocol"] == "openai_chat" and parsed["id"] == r.id
    assert int(parsed["tokens_in"]) == r.usage.prompt_tokens
    assert int(parsed["tokens_out"]) == r.usage.completion_tokens
    assert float(parsed["duration"]) >= float(parsed["ttft"]) >= 0
    assert parsed["client"].startswith("127.0.0.1:")
    assert parsed["finish"] in ("stop", "length")


def test_generated_ids_and_errors(log_server, access):
    url = log_server.url
    answers = [
        httpx.post(f"{url}{CHAT}", json={"messages": MSGS, "temperature": 9}),  # 400
        httpx.get(f"{url}/no/such/path"),  # 404
        httpx.post(f"{url}{CHAT}", content=b"x" * 5000),  # 413 from the body limit
        httpx.post(f"{url}/v1/messages", json={"max_tokens": 2}),  # 400, Anthropic
    ]
    assert [a.status_code for a in answers] == [400, 404, 413, 400]
    ids = [a.headers["x-request-id"] for a in answers]
    assert all(re.fullmatch(r"[0-9a-f]{32}", i) for i in ids) and len(set(ids)) == 4
    lines = access()
    assert [f["request_id"] for f, _ in lines] == ids
    assert [f["status"] for f, _ in lines] == [400, 404, 413, 400]
    assert [f["protocol"] for f, _ in lines] == [
        "openai_chat",
        "other",
        "openai_chat",
        "anthropic_messages",
    ]
    assert all("tokens_in" not in f for f, _ in lines)  # none reached the engine


@pytest.mark.parametrize(
    "given",
    ["x" * 129, "bad id", "a\tb", "ünï", ""],
)
def test_unusable_request_ids_are_replaced(log_server, given):
    r = httpx.get(f"{log_server.url}/v1/models", headers={"X-Request-Id": given.encode()})
    assert r.status_code == 200
    assert re.fullmatch(r"[0-9a-f]{32}", r.headers["x-request-id"])


def test_usable_request_id_kept(log_server):
    given = "0f8e-AB:c/d+e=." + "z" * 113  # 128 characters of the allowed set
    r = httpx.get(f"{log_server.url}/v1/models", headers={"X-Request-Id": given})
    assert r.headers["x-request-id"] == given


def test_stream_has_the_id_and_one_line(log_server, access):
    body = {"messages": MSGS, "max_tokens": 4, "stream": True}
    headers = {"X-Request-Id": "stream-1"}
    with httpx.stream(
        "POST", f"{log_server.url}{CHAT}", json=body, headers=headers, timeout=60
    ) as r:
        text = "".join(r.iter_text())
    assert r.headers["x-request-id"] == "stream-1" and text.rstrip().endswith("[DONE]")
    lines = access()
    assert len(lines) == 1
    fields, _ = lines[0]
    assert fields["request_id"] == "stream-1" and fields["status"] == 200
    assert fields["tokens_out"] >= 1 and fields["id"].startswith("chatcmpl-")


def test_monitoring_endpoints_log_at_debug_only(log_server, access):
    for path in ("/health", "/metrics"):
        r = httpx.get(f"{log_server.url}{path}")
        assert r.status_code == 200 and re.fullmatch(r"[0-9a-f]{32}", r.headers["x-request-id"])
    assert access() == []
    assert [f["path"] for f, _ in access(logging.DEBUG)] == ["/health", "/metrics"]


def test_server_thread_turns_uvicorn_access_log_off(log_server):
    # (pytest attaches its capture handler to non-propagating loggers, which re-enables
    # uvicorn's access log under pytest; the CLI test below checks the real output.)
    assert log_server.server.config.access_log is False


@pytest.mark.slow  # a subprocess importing torch
def test_cli_logs_each_request_once(model_dir):
    port = free_port()
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "astrai.serve",
            f"model_path={model_dir}",
            f"port={port}",
            "engine=contiguous",
            "engine.max_batch_size=2",
        ],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        url = f"http://127.0.0.1:{port}"
        wait_healthy(proc, url, 120)
        body = {"messages": MSGS, "max_tokens": 3}
        r = httpx.post(url + CHAT, json=body, headers={"X-Request-Id": "cli-1"}, timeout=60)
        assert r.status_code == 200 and r.headers["x-request-id"] == "cli-1"
        assert httpx.get(url + "/nope").status_code == 404
        assert httpx.get(url + "/metrics").status_code == 200
    finally:
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0, out
    lines = out.splitlines()
    chat = [line for line in lines if CHAT in line]
    assert len(chat) == 1, out  # ours only: uvicorn's access log is off
    fields = parse_logfmt(chat[0][chat[0].index("request_id=") :])
    assert fields["request_id"] == "cli-1" and fields["status"] == "200"
    assert int(fields["tokens_out"]) == r.json()["usage"]["completion_tokens"]
    assert len([line for line in lines if "/nope" in line]) == 1, out
    assert not [line for line in lines if "/health" in line or "/metrics" in line], out


def test_a_hostile_path_stays_on_one_quoted_line(log_server, access):
    r = httpx.get(f"{log_server.url}/a%0Aforged=1%20%22x%22")
    assert r.status_code == 404
    [(fields, message)] = access()
    assert "\n" not in message and fields["path"] == '/a\nforged=1 "x"'
    assert parse_logfmt(message)["path"] == '/a\\nforged=1 "x"'  # JSON-escaped newline


def test_a_crash_is_a_500_with_the_id_and_one_line(engine, access):
    app = create_app(engine)

    @app.get("/v1/boom")
    async def boom() -> None:
        raise RuntimeError("boom")

    with ServerThread(app) as srv:
        r = httpx.get(f"{srv.url}/v1/boom", headers={"X-Request-Id": "crash-1"})
    assert r.status_code == 500 and r.headers["x-request-id"] == "crash-1"
    assert r.json()["error"]["type"] == "server_error"
    [(fields, _)] = access()
    assert fields["request_id"] == "crash-1" and fields["status"] == 500
