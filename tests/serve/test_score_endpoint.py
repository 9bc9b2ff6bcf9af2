"""``POST /v1/score`` over real HTTP: the scores of a reward model served next to the
generative one equal transformers' ``AutoModelForSequenceClassification`` on the same chat
rendering; bad requests get a 400/404 naming the field (and the server goes on); without a
reward model the route says how to load one."""

from __future__ import annotations

import threading
import time

import httpx
import pytest
import torch

from astrai.model import load_pretrained
from astrai.model.reward import RewardModel, render_for_reward, save_reward_model
from astrai.serve import ServerThread, ServeSettings, create_app
from astrai.serve.score import RewardScorer

transformers = pytest.importorskip("transformers")

PROMPT = "What is 2 + 2?"
ANSWERS = ["4", "It is five.", "I do not know, sorry."]


@pytest.fixture(scope="module")
def reward_dir(model_dir, tmp_path_factory):
    torch.manual_seed(0)
    model = RewardModel.from_backbone(load_pretrained(model_dir, dtype=torch.float32))
    with torch.no_grad():
        model.score.weight.normal_(0.0, 0.5)
    from astrai.tokenizer import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    return save_reward_model(model, tmp_path_factory.mktemp("rm") / "rm", tokenizer=tok)


@pytest.fixture(scope="module")
def scorer(reward_dir):
    scorer = RewardScorer.from_pretrained(reward_dir, name="rm", max_batch_tokens=64)
    scorer.max_tokens = 80  # a small context, so "too long" is cheap to reach
    threads: set[str] = set()
    score = scorer.score

    def recording(sequences):
        threads.add(threading.current_thread().name)
        return score(sequences)

    scorer.score = recording
    scorer.threads = threads
    return scorer


@pytest.fixture(scope="module")
def url(engine, scorer):
    app = create_app(engine, ServeSettings(max_prompt_chars=300), reward=scorer)
    with ServerThread(app) as srv:
        yield srv.url + "/v1/score"


def _hf(reward_dir, sequences):
    hf = transformers.AutoModelForSequenceClassification.from_pretrained(reward_dir).eval()
    with torch.no_grad():  # one sequence at a time: nothing padded on this side
        return [hf(input_ids=torch.tensor([s])).logits[0, 0].item() for s in sequences]


def test_scores_equal_transformers(url, reward_dir, scorer):
    r = httpx.post(url, json={"model": "rm", "text_1": PROMPT, "text_2": ANSWERS}, timeout=60)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "list" and body["model"] == "rm" and body["id"].startswith("score-")
    assert isinstance(body["created"], int)
    assert [d["index"] for d in body["data"]] == [0, 1, 2]
    assert {d["object"] for d in body["data"]} == {"score"}
    sequences = [render_for_reward(scorer.tokenizer, PROMPT, a) for a in ANSWERS]
    expected = _hf(reward_dir, sequences)
    assert max(expected) - min(expected) > 1e-3
    got = [d["score"] for d in body["data"]]
    assert got == pytest.approx(expected, abs=1e-5)
    n = sum(len(s) for s in sequences)
    assert body["usage"] == {"prompt_tokens": n, "total_tokens": n}
    assert scorer.threads == {"astrai-score_0"}  # the forward ran off the event loop
    # two lists of one length pair up; `model` may be left out
    pairs = {"text_1": [PROMPT, "Say hi."], "text_2": [ANSWERS[1], "hi"]}
    r = httpx.post(url, json=pairs, timeout=60)
    assert r.status_code == 200, r.text
    seqs = [render_for_reward(scorer.tokenizer, p, c) for p, c in zip(*pairs.values())]
    assert [d["score"] for d in r.json()["data"]] == pytest.approx(_hf(reward_dir, seqs), abs=1e-5)


BAD = [
    ({"text_1": [], "text_2": ["x"]}, 400, "text_1"),
    ({"text_1": PROMPT, "text_2": []}, 400, "text_2"),
    ({"text_1": ["a", "b"], "text_2": ["x", "y", "z"]}, 400, "text_2"),
    ({"text_1": PROMPT, "text_2": ["x", 3]}, 400, "text_2"),
    ({"text_1": 5, "text_2": "x"}, 400, "text_1"),
    ({"text_1": {"role": "user"}, "text_2": "x"}, 400, "text_1"),
    ({"text_2": "x"}, 400, "text_1"),
    ({"text_1": PROMPT}, 400, "text_2"),
    ({"text_1": PROMPT, "text_2": "y" * 301}, 400, "text_2"),  # over max_prompt_chars
    ({"text_1": PROMPT, "text_2": "7 " * 140}, 400, "text_2"),  # over the model's context
    (b'{"text_1": "\\ud800", "text_2": "x"}', 400, "text_1"),  # a lone surrogate
    ({"model": "nope", "text_1": PROMPT, "text_2": "4"}, 404, "model"),
    ({"model": 3, "text_1": PROMPT, "text_2": "4"}, 400, "model"),
]


@pytest.mark.parametrize("body, status, field", BAD)
def test_bad_requests_name_the_field(url, body, status, field):
    if isinstance(body, bytes):
        r = httpx.post(url, content=body, headers={"content-type": "application/json"})
    else:
        r = httpx.post(url, json=body, timeout=60)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["param"] == field, err
    ok = httpx.post(url, json={"text_1": PROMPT, "text_2": "4"}, timeout=60)
    assert ok.status_code == 200  # one bad request never stops the server


def test_not_json_and_listed_model(url):
    r = httpx.post(url, content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400 and "error" in r.json()
    models = httpx.get(url.replace("/v1/score", "/v1/models")).json()
    assert [m["id"] for m in models["data"]] == ["astrai", "rm"]
    assert httpx.get(url.replace("/v1/score", "/v1/models/rm")).status_code == 200
    doc = httpx.get(url.replace("/v1/score", "/openapi.json")).json()
    responses = doc["paths"]["/v1/score"]["post"]["responses"]
    assert {"200", "400", "404"} <= set(responses) and "422" not in responses


def test_without_a_reward_model_the_route_says_how_to_load_one(base_url):
    r = httpx.post(base_url + "/v1/score", json={"text_1": PROMPT, "text_2": "4"}, timeout=30)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["code"] == "reward_model_not_loaded"
    assert "no reward model is loaded" in err["message"]
    assert "reward_model=" in err["message"] and "strategy=reward" in err["message"]


def test_the_serve_command_loads_the_reward_model_or_names_the_key(reward_dir, model_dir):
    from astrai.serve.__main__ import build_reward

    assert build_reward({"reward_model": None}) is None
    scorer = build_reward({"reward_model": str(reward_dir), "device": "cpu"})
    try:
        assert scorer.name == reward_dir.name and scorer.model.score.weight.shape == (1, 64)
    finally:
        scorer.close()
    with pytest.raises(SystemExit, match=r"reward_model=.*score\.weight"):
        build_reward({"reward_model": str(model_dir), "device": "cpu"})  # a causal LM


def test_max_client_batch_size_is_a_serve_option_checked_at_start_up():
    from astrai.serve.__main__ import settings_of

    assert settings_of({"model_path": "/m"}).max_client_batch_size == 1024
    assert settings_of({"model_path": "/m", "max_client_batch_size": 8}).max_client_batch_size == 8
    for bad in (0, -1, 2.5, "many"):
        with pytest.raises(SystemExit, match="max_client_batch_size: must be a positive int"):
            settings_of({"model_path": "/m", "max_client_batch_size": bad})


@pytest.mark.slow  # a subprocess that imports torch and loads two models: ~20 s
def test_serve_command_with_reward_model(model_dir, reward_dir):
    import os
    import signal
    import subprocess
    import sys
    from pathlib import Path

    from server_process import free_port, wait_healthy

    port = free_port()
    command = [sys.executable, "-m", "astrai.serve", f"model_path={model_dir}", f"port={port}"]
    command += [f"reward_model={reward_dir}", "engine.kv_tokens=4096", "engine.max_batch_size=4"]
    command += ["max_client_batch_size=3"]
    root = Path(__file__).resolve().parents[2]
    proc = subprocess.Popen(
        command,
        cwd=root,
        env=dict(os.environ),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        url = f"http://127.0.0.1:{port}"
        wait_healthy(proc, url, 120)
        body = {"model": reward_dir.name, "text_1": PROMPT, "text_2": ANSWERS}
        r = httpx.post(url + "/v1/score", json=body, timeout=60)
        assert r.status_code == 200, r.text
        from astrai.tokenizer import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(reward_dir)
        expected = _hf(reward_dir, [render_for_reward(tok, PROMPT, a) for a in ANSWERS])
        assert [d["score"] for d in r.json()["data"]] == pytest.approx(expected, abs=1e-5)
        body["text_2"] = [*ANSWERS, "4"]  # one pair over max_client_batch_size=3
        r = httpx.post(url + "/v1/score", json=body, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["code"] == "too_many_pairs", r.text
    finally:
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0, out


# --------------------------------------------------------------------------- chunks
class _Gated:
    """`scorer.score`, recording each call's request (by its prompt, "A" or "B") once per
    pair it scores; request A's calls wait for the test to let each one through."""

    def __init__(self, scorer: RewardScorer) -> None:
        self.scorer, self.score = scorer, scorer.score
        self.log: list[str] = []
        self.a_started = threading.Semaphore(0)
        self.a_go = threading.Semaphore(0)

    def __call__(self, sequences):
        tag = "A" if "ALPHA" in self.scorer.tokenizer.decode(sequences[0]) else "B"
        self.log += [tag] * len(sequences)
        if tag == "A":
            self.a_started.release()
            assert self.a_go.acquire(timeout=60), "the test never let chunk A through"
        return self.score(sequences)


@pytest.fixture
def gated(reward_dir, engine):
    """A server whose scorer takes one pair per chunk (max_batch_tokens=1), gated."""
    scorer = RewardScorer.from_pretrained(reward_dir, name="rm", max_batch_tokens=1)
    scorer.score = gate = _Gated(scorer)
    app = create_app(engine, ServeSettings(max_client_batch_size=40), reward=scorer)
    with ServerThread(app) as srv:
        yield srv, gate
    for _ in range(100):  # never leave the scorer's thread waiting
        gate.a_go.release()


def _raw_post(port: int, body: dict):
    import json
    import socket

    data = json.dumps(body).encode()
    sock = socket.create_connection(("127.0.0.1", port))
    head = (
        f"POST /v1/score HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(data)}\r\n\r\n"
    )
    sock.sendall(head.encode() + data)
    return sock


A_JOB = {"text_1": "ALPHA", "text_2": [f"answer {i}" for i in range(40)]}
B_JOB = {"text_1": "BETA", "text_2": ["4"]}


def test_an_abandoned_job_stops_between_chunks(gated):
    """The client of a 40-pair job (a chunk per pair) leaves while its first chunk runs: the
    job stops at a chunk boundary (counted: at most one more of its pairs is scored once
    the client has gone), and the next request is answered after at most that chunk."""
    srv, gate = gated
    sock = _raw_post(srv.port, A_JOB)
    assert gate.a_started.acquire(timeout=60)  # chunk 1 of A is running
    sock.close()  # the client gives up
    time.sleep(0.3)  # the server reads the hang-up on its event loop, which is idle
    for _ in range(40):
        gate.a_go.release()  # nothing holds A back any more
    r = httpx.post(srv.url + "/v1/score", json=B_JOB, timeout=60)
    assert r.status_code == 200, r.text
    assert gate.log.count("B") == 1
    after = gate.log[1:]  # what ran once the client had gone, B included
    assert after.count("A") <= 1, gate.log
    assert gate.log.index("B") <= 2


def test_a_long_job_lets_another_request_through_between_its_chunks(gated):
    """Chunks of concurrent requests take turns on the scorer's thread: a one-pair request
    sent while a 40-pair job runs is scored long before that job ends."""
    srv, gate = gated
    results: dict[str, httpx.Response] = {}

    def send(name: str, body: dict) -> None:
        results[name] = httpx.post(srv.url + "/v1/score", json=body, timeout=120)

    a = threading.Thread(target=send, args=("A", A_JOB))
    a.start()
    assert gate.a_started.acquire(timeout=60)  # A's first chunk runs
    b = threading.Thread(target=send, args=("B", B_JOB))
    b.start()
    time.sleep(0.3)  # B arrives and queues its chunk while A's first one is held
    for _ in range(40):
        gate.a_go.release()
    a.join(120)
    b.join(120)
    assert results["A"].status_code == results["B"].status_code == 200
    assert len(results["A"].json()["data"]) == 40
    assert gate.log.count("A") == 40
    assert gate.log.index("B") <= 2, gate.log  # B waited for at most one more chunk of A


def test_more_pairs_than_max_client_batch_size_is_a_400(gated):
    srv, gate = gated
    too_many = {"text_1": "ALPHA", "text_2": ["x"] * 41}
    r = httpx.post(srv.url + "/v1/score", json=too_many, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "text_2" and err["code"] == "too_many_pairs"
    assert "max_client_batch_size" in err["message"] and "40" in err["message"]
    assert gate.log == []  # refused before any scoring


def test_request_timeout_stops_a_job_between_chunks(reward_dir, engine):
    """Past `request_timeout_s` the job stops at the next chunk boundary with a 504."""
    scorer = RewardScorer.from_pretrained(reward_dir, name="rm", max_batch_tokens=1)
    chunks: list[int] = []
    score = scorer.score

    def slow(sequences):
        chunks.append(len(sequences))
        time.sleep(0.05)
        return score(sequences)

    scorer.score = slow
    app = create_app(engine, ServeSettings(request_timeout_s=0.2), reward=scorer)
    with ServerThread(app) as srv:
        r = httpx.post(srv.url + "/v1/score", json=A_JOB, timeout=60)
    assert r.status_code == 504, r.text
    assert r.json()["error"]["code"] == "timeout"
    assert 1 <= len(chunks) < 40
