"""``POST /v1/score`` over real HTTP: the scores of a reward model served next to the
generative one equal transformers' ``AutoModelForSequenceClassification`` on the same chat
rendering; bad requests get a 400/404 naming the field (and the server goes on); without a
reward model the route says how to load one."""

from __future__ import annotations

import threading

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
    finally:
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0, out
