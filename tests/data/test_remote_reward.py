"""RemoteReward (astrai/data/remote_reward.py) against a small HTTP server started here that
speaks OpenRLHF's ``--remote_rm_url`` protocol (``remote_rm_fn``'s body and answer)."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import ClassVar

import pytest

from astrai.train.strategies.grpo.reward_pool import RewardPool
from astrai.train.strategies.grpo.rewards import parse_rewards


class PoolingServer(BaseHTTPRequestHandler):
    """vLLM's Pooling API for a reward model: per input, one value per token (its length in
    tokens of one character), the last the sequence's reward: ``len(input) / 10``; answered
    out of index order, as a server may."""

    bodies: ClassVar[list[dict]] = []

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        type(self).bodies.append({"path": self.path, **body})
        data = [
            {"index": i, "object": "pooling", "data": [[k / 10] for k in range(1, len(t) + 1)]}
            for i, t in enumerate(body["input"])
        ]
        out = json.dumps({"object": "list", "data": data[::-1]}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(out)))
        self.end_headers()
        self.wfile.write(out)

    def log_message(self, *args):
        pass


class RewardServer(BaseHTTPRequestHandler):
    """reward = 1.0 when the label ends the query, else the query's length / 100; a query
    containing "crash" answers 500, "short" answers one reward too few."""

    bodies: ClassVar[list[dict]] = []

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        type(self).bodies.append(
            {"path": self.path, "auth": self.headers.get("Authorization"), **body}
        )
        if any("crash" in q for q in body["query"]):
            self.send_response(500)
            self.end_headers()
            return
        rewards = [
            1.0 if q.endswith(label) and label else len(q) / 100
            for q, label in zip(body["query"], body["labels"])
        ]
        if any("short" in q for q in body["query"]):
            rewards = rewards[:-1]
        out = json.dumps({"rewards": rewards}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(out)))
        self.end_headers()
        self.wfile.write(out)

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def server():
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), RewardServer)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}/get_reward"
    httpd.shutdown()


def test_a_group_is_one_openrlhf_request(server):
    RewardServer.bodies.clear()
    rewards = parse_rewards(
        [
            {
                "_target_": "astrai.data.remote_reward.RemoteReward",
                "url": server,
                "name": "rm",
                "api_key": "k",
            }
        ]
    )
    pool = RewardPool(rewards, 4)
    records = [{"prompt": "2+3=", "answer": "5"}] * 2 + [{"prompt": "1+1=", "answer": "2"}] * 2
    texts = ["5", "four", "2", "xx"]
    scoring = pool.session(records, 2)
    columns, failures = scoring.finish(texts)
    assert columns["rm"].tolist() == pytest.approx([1.0, 0.08, 1.0, 0.06])
    assert failures == {"reward/rm/failures": 0.0}
    bodies = sorted(RewardServer.bodies, key=lambda b: b["prompts"][0])
    assert len(bodies) == 2  # one request per group of 2
    assert bodies[1] == {
        "path": "/get_reward",
        "auth": "Bearer k",
        "query": ["2+3=5", "2+3=four"],
        "prompts": ["2+3=", "2+3="],
        "labels": ["5", "5"],
    }


def test_a_failed_request_or_a_short_answer_is_the_failure_value(server):
    rewards = parse_rewards(
        [
            {
                "_target_": "astrai.data.remote_reward.RemoteReward",
                "url": server,
                "name": "rm",
                "failure_value": -1.0,
            }
        ]
    )
    records = [{"prompt": "q", "answer": "a"}] * 4
    columns, failures = RewardPool(rewards, 4).score(records, ["crash", "a", "short", "a"])
    assert columns["rm"].tolist() == [-1.0] * 4  # 4 completions in one group: one request
    assert failures == {"reward/rm/failures": 4.0}
    scoring = RewardPool(rewards, 4).session(records, 2)
    columns, failures = scoring.finish(["a", "b", "short", "a"])
    assert columns["rm"].tolist() == pytest.approx([1.0, 0.02, -1.0, -1.0])
    assert failures == {"reward/rm/failures": 2.0}


def test_chat_prompts_and_the_synchronous_call(server):
    from astrai.data.remote_reward import RemoteReward

    reward = RemoteReward(server, prompt_field="messages")
    record = {"messages": [{"role": "user", "content": "say hi"}], "answer": "hi"}
    assert reward(record, " hi") == 1.0
    with pytest.raises(ValueError, match="format"):
        RemoteReward(server, format="grpc")
    with pytest.raises(ValueError, match="model"):
        RemoteReward(server, format="openai")
    with pytest.raises(ValueError, match="url"):
        RemoteReward("localhost:5000")


def test_the_openai_format_is_vllms_pooling_api():
    """``format: openai``: ``{model, input}`` to ``/pooling``, the reward the last token's value
    of each input's ``data``, matched by ``index``."""
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), PoolingServer)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{httpd.server_address[1]}/pooling"
        rewards = parse_rewards(
            [
                {
                    "_target_": "astrai.data.remote_reward.RemoteReward",
                    "url": url,
                    "format": "openai",
                    "model": "rm",
                    "name": "rm",
                }
            ]
        )
        PoolingServer.bodies.clear()
        records = [{"prompt": "ab"}] * 2 + [{"prompt": "c"}] * 2
        columns, failures = (
            RewardPool(rewards, 2).session(records, 2).finish(["x", "yyy", "", "zz"])
        )
        assert columns["rm"].tolist() == pytest.approx([0.3, 0.5, 0.1, 0.3])
        assert failures == {"reward/rm/failures": 0.0}
        bodies = sorted(PoolingServer.bodies, key=lambda b: b["input"][0])
        assert bodies == [
            {"path": "/pooling", "model": "rm", "input": ["abx", "abyyy"]},
            {"path": "/pooling", "model": "rm", "input": ["c", "czz"]},
        ]
    finally:
        httpd.shutdown()
