"""JudgeReward (astrai/data/judge_reward.py) against a real ``python -m astrai.serve`` with a
tiny random model: the verdict goes through the ``json_schema`` response format (the same
prompt unconstrained is no verdict), and a fixed seed gives identical rewards on two runs."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from server_process import free_port, stop, wait_healthy

from astrai.data.judge_reward import JudgeReward
from astrai.train.strategies.grpo.reward_pool import RewardPool
from astrai.train.strategies.grpo.rewards import parse_rewards

ROOT = Path(__file__).resolve().parents[2]
TEXTS = ['{"score": 7} The answer is 12. What is 3 + 4? 0123456789 grade\n' * 20]


@pytest.fixture(scope="module")
def judge_url(tmp_path_factory, build_model_dir):
    model = build_model_dir(tmp_path_factory.mktemp("judge"), TEXTS, max_position_embeddings=512)
    port = free_port()
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "astrai.serve",
            f"model_path={model}",
            f"port={port}",
            "engine.max_batch_size=4",
            "engine.batch_invariant=true",  # a verdict independent of its batch neighbours
        ],
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(proc, url, 180)
        yield url
    finally:
        stop(proc)


RECORDS = [
    {"prompt": "What is 3 + 4?", "answer": "7"},
    {"prompt": "What is 5 * 2?", "answer": "10"},
]
COMPLETIONS = ["7", "The answer is 7.", "8", "10", "ten", "The answer is 12."]


def judged(url: str, seed: int):
    entry = {
        "_target_": "astrai.data.judge_reward.JudgeReward",
        "url": url,
        "name": "judge",
        "seed": seed,
        "temperature": 1.0,  # sampled: only the seed makes the verdict replay
        "max_tokens": 24,
    }
    pool = RewardPool(parse_rewards([entry]), 8)
    records = [RECORDS[i // 3] for i in range(6)]
    return pool.score(records, COMPLETIONS)


@pytest.mark.slow  # a server subprocess (~15 s to start on a loaded machine)
def test_the_judge_replays_with_its_seed_through_json_schema(judge_url):
    first, failures = judged(judge_url, seed=3)
    second, _ = judged(judge_url, seed=3)
    assert first["judge"].tolist() == second["judge"].tolist()
    assert failures == {"reward/judge/failures": 0.0}  # every verdict parsed and in range
    assert all(0.0 <= v <= 1.0 for v in first["judge"].tolist())
    others = [judged(judge_url, seed=s)[0]["judge"].tolist() for s in (4, 5, 6)]
    assert any(o != first["judge"].tolist() for o in others)  # the seed matters

    # the same request without the response format is no verdict: the schema did the work
    judge = JudgeReward(judge_url, seed=3, temperature=1.0, max_tokens=24)
    body = judge.request(RECORDS[0], COMPLETIONS[0])
    assert body["response_format"]["type"] == "json_schema"
    body.pop("response_format")
    free = httpx.post(judge.endpoint, json=body, timeout=60).json()
    with pytest.raises(ValueError, match="verdict"):
        judge.verdict(free["choices"][0]["message"]["content"])


def test_verdict_parsing():
    judge = JudgeReward("http://127.0.0.1:1", min_score=1, max_score=5)
    assert judge.verdict('{"score": 3}') == 0.5
    for bad in ("3", '{"score": 9}', '{"score": "3"}', '{"grade": 3}', "", '{"score": true}'):
        with pytest.raises(ValueError):
            judge.verdict(bad)
    request = judge.request({"prompt": "q"}, "c")
    assert request["seed"] == 0 and request["temperature"] == 0.0
    schema = request["response_format"]["json_schema"]["schema"]
    assert schema["properties"]["score"]["enum"] == [1, 2, 3, 4, 5]
    assert "Question: q" in request["messages"][0]["content"]
    assert "Reference answer: \n" in request["messages"][0]["content"]  # absent field: ''
    assert json.loads(json.dumps(request))  # plain JSON
    with pytest.raises(ValueError, match="completion"):
        JudgeReward("http://x", rubric="no completion here")


def test_an_unreachable_judge_is_a_failure_not_a_crash():
    entry = {
        "_target_": "astrai.data.judge_reward.JudgeReward",
        "url": f"http://127.0.0.1:{free_port()}",
        "name": "judge",
        "failure_value": -1.0,
        "request_timeout": 2.0,
    }
    columns, failures = RewardPool(parse_rewards([entry])).score([{}, {}], ["a", "b"])
    assert columns["judge"].tolist() == [-1.0, -1.0]
    assert failures == {"reward/judge/failures": 2.0}
