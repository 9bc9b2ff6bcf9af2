"""`ReplicaClient` against a served engine: `generate` equals `run_batch`, and each kind of
failure becomes the error a caller acts on (retry elsewhere, or not)."""

from __future__ import annotations

import pytest
from fastapi import FastAPI
from fastapi.responses import JSONResponse
from server_process import free_port

from astrai.inference import InferenceEngine, SamplingParams
from astrai.model import AutoModel
from astrai.remote import (
    RemoteResult,
    ReplicaClient,
    ReplicaError,
    ReplicaUnavailable,
    StalePolicyVersion,
)
from astrai.serve import ServerThread, ServeSettings, create_app

PROMPT = [9, 31, 4, 77]


@pytest.fixture(scope="module")
def served(remote_model_dir, remote_tokenizer):
    engine = InferenceEngine(
        AutoModel.from_pretrained(remote_model_dir),
        remote_tokenizer,
        max_batch_size=4,
        max_seq_len=128,
        cache_mode="contiguous",
    )
    with ServerThread(create_app(engine, ServeSettings(api_key="s3cret"))) as srv:
        yield srv.url, engine
    engine.shutdown()


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0, max_tokens=5),
        SamplingParams(temperature=0.8, top_p=0.9, max_tokens=7, n=3, logprobs_mode="scaled"),
    ],
)
def test_generate_equals_run_batch(served, params):
    url, engine = served
    client = ReplicaClient(url, api_key="s3cret")
    got = client.generate([PROMPT], params, seed=21, policy_version=engine.policy_version)
    want = engine.run_batch([PROMPT], params, seed=21, return_details=True)
    assert all(isinstance(g, RemoteResult) for g in got)
    assert [(g.token_ids, g.logprobs, g.finish_reason, g.error) for g in got] == [
        (w.token_ids, w.logprobs, w.finish_reason, w.error) for w in want
    ]
    assert client.health() and client.policy_version() == engine.policy_version


def test_replica_answers_become_errors(served):
    url, _ = served
    client = ReplicaClient(url, api_key="s3cret")
    with pytest.raises(StalePolicyVersion, match="policy version 7") as stale:
        client.generate([PROMPT], SamplingParams(max_tokens=2), seed=0, policy_version=7)
    assert stale.value.status == 409 and stale.value.code == "stale_policy_version"
    with pytest.raises(ReplicaError, match="top_p") as bad:
        client.generate([PROMPT], SamplingParams(top_p=2.0), seed=0)
    assert bad.value.status == 400 and not isinstance(bad.value, StalePolicyVersion)
    with pytest.raises(ReplicaError, match="API key"):
        ReplicaClient(url).policy_version()
    with pytest.raises(ReplicaError, match="allow_weight_updates"):  # off here: 403
        client.pause()


def test_unreachable_or_failing_replicas_are_unavailable():
    closed = ReplicaClient(f"http://127.0.0.1:{free_port()}", timeout=5)
    assert closed.health() is False
    with pytest.raises(ReplicaUnavailable):
        closed.generate([PROMPT], SamplingParams(), seed=0)
    app = FastAPI()

    @app.get("/get_weight_version")
    async def broken() -> JSONResponse:
        return JSONResponse({"error": {"message": "engine crashed"}}, status_code=500)

    with ServerThread(app) as srv:
        with pytest.raises(ReplicaUnavailable, match="engine crashed"):
            ReplicaClient(srv.url).policy_version()
        assert ReplicaClient(srv.url).health() is False  # no /health: 404
