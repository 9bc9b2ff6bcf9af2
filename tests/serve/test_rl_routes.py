"""The replica's RL routes over real HTTP: `/generate` against `run_batch`, stale policy
versions, bad fields, `X-Policy-Version`, the opt-in routes' 403 / 401, and pause /
continue (weight updates themselves: test_weight_updates.py)."""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest

from astrai.inference import InferenceEngine, SamplingParams
from astrai.model import AutoModel
from astrai.serve import ServerThread, ServeSettings, create_app

OPT_IN = (
    "/pause_generation",
    "/continue_generation",
    "/init_weights_update_group",
    "/destroy_weights_update_group",
    "/update_weights_from_disk",
    "/update_weights_from_distributed",
)
PROMPTS = [[5, 17, 30, 2], [40, 41], [7, 8, 9, 10, 11, 12]]


@pytest.fixture(scope="module")
def rl_engine(model_dir, tokenizer):
    """Batch invariant: a prompt group's tokens and log-probs do not depend on what else
    runs in the engine's steps (helper inv's engine option), so `/generate` through the
    background loop can equal `run_batch` bit for bit."""
    model = AutoModel.from_pretrained(model_dir)
    eng = InferenceEngine(model, tokenizer, max_batch_size=8, max_seq_len=256, batch_invariant=True)
    yield eng
    eng.shutdown()


@pytest.fixture(scope="module")
def rl_server(rl_engine):
    app = create_app(rl_engine, ServeSettings(allow_weight_updates=True))
    with ServerThread(app) as srv:
        yield srv


def _generate(url: str, **body) -> httpx.Response:
    return httpx.post(url + "/generate", json=body, timeout=120)


@pytest.mark.parametrize(
    "sampling",
    [
        {"temperature": 0, "max_tokens": 6},
        {"temperature": 0.9, "top_k": 20, "max_tokens": 8, "n": 3, "logprobs_mode": "scaled"},
    ],
)
def test_generate_equals_run_batch(rl_server, rl_engine, sampling):
    r = _generate(rl_server.url, input_ids=PROMPTS, sampling_params=sampling, seed=11)
    assert r.status_code == 200, r.text
    answer = r.json()
    assert answer["policy_version"] == rl_engine.policy_version
    assert r.headers["x-policy-version"] == str(rl_engine.policy_version)
    want = rl_engine.run_batch(PROMPTS, SamplingParams(**sampling), seed=11, return_details=True)
    assert len(answer["outputs"]) == len(PROMPTS) * sampling.get("n", 1)
    for got, ref in zip(answer["outputs"], want, strict=True):
        assert got["output_ids"] == ref.token_ids
        assert got["logprobs"] == ref.logprobs  # bit for bit: floats as JSON round-trip
        assert got["finish_reason"] == ref.finish_reason
        assert got["error"] is None


def test_concurrent_generates_equal_each_alone(rl_server, rl_engine):
    """Requests batched together by the loop get what each gets alone (batch invariance)."""
    sampling = {"temperature": 1.0, "max_tokens": 8, "n": 2}
    alone = [
        _generate(rl_server.url, input_ids=[p], sampling_params=sampling, seed=3).json()
        for p in PROMPTS
    ]
    together: list = [None] * len(PROMPTS)

    def send(i: int) -> None:
        together[i] = _generate(
            rl_server.url, input_ids=[PROMPTS[i]], sampling_params=sampling, seed=3
        ).json()

    threads = [threading.Thread(target=send, args=(i,)) for i in range(len(PROMPTS))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert together == alone


def test_stale_policy_version_is_a_409_naming_both(rl_server, rl_engine):
    current = rl_engine.policy_version
    r = _generate(rl_server.url, input_ids=[[1, 2]], policy_version=current + 4)
    assert r.status_code == 409
    error = r.json()["error"]
    assert error["code"] == "stale_policy_version"
    assert f"policy version {current + 4}" in error["message"]
    assert f"holds version {current}" in error["message"]
    ok = _generate(rl_server.url, input_ids=[[1, 2]], policy_version=current)
    assert ok.status_code == 200 and ok.json()["policy_version"] == current


@pytest.mark.parametrize(
    "body, param",
    [
        ({"input_ids": [[1, 2]], "sampling_params": {"top_p": 2}}, "sampling_params.top_p"),
        ({"input_ids": [[1, 2]], "sampling_params": {"seed": 1}}, "sampling_params.seed"),
        ({"input_ids": [[1, 2]], "sampling_params": {"best_of": 2}}, "sampling_params.best_of"),
        ({"input_ids": [["a"]]}, "input_ids.0.0"),
        ({"input_ids": []}, "input_ids"),
        ({"input_ids": [[1]], "seed": "x"}, "seed"),
        ({"input_ids": [[1]], "sampling_params": {"stop_token_ids": [99999]}}, "stop_ids"),
    ],
)
def test_bad_fields_are_400s_naming_them(rl_server, body, param):
    r = httpx.post(rl_server.url + "/generate", json=body, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param
    assert r.headers["x-policy-version"].isdigit()


def test_a_prompt_the_engine_rejects_is_an_output_as_in_run_batch(rl_server, rl_engine):
    too_long = list(range(5, 5 + 300))  # beyond max_seq_len
    r = _generate(rl_server.url, input_ids=[[1, 2], too_long], sampling_params={"max_tokens": 2})
    assert r.status_code == 200, r.text
    outs = r.json()["outputs"]
    ref = rl_engine.run_batch([[1, 2], too_long], max_tokens=2, return_details=True)
    assert [o["finish_reason"] for o in outs] == [x.finish_reason for x in ref]
    assert outs[1]["finish_reason"] == "rejected" and outs[1]["error"]


def test_every_response_carries_the_policy_version(rl_server, rl_engine):
    version = str(rl_engine.policy_version)
    for method, path in (("GET", "/health"), ("GET", "/v1/models"), ("GET", "/nope")):
        r = httpx.request(method, rl_server.url + path)
        assert r.headers["x-policy-version"] == version, path
    r = httpx.get(rl_server.url + "/get_weight_version")
    assert r.json() == {"policy_version": rl_engine.policy_version}


@pytest.mark.parametrize("path", OPT_IN)
def test_opt_in_routes_are_403_without_reading_the_body(engine, path, monkeypatch):
    """Off (the default), each opt-in route answers 403 before its body is read: a body
    that is not even JSON gets the 403, and `json_body` is never called."""
    import astrai.serve.weight_routes as routes

    def never(request):
        raise AssertionError("the body was read")

    monkeypatch.setattr(routes, "json_body", never)
    with ServerThread(create_app(engine, ServeSettings())) as srv:
        r = httpx.post(srv.url + path, content=b"{not json", timeout=30)
        assert r.status_code == 403, r.text
        assert r.json()["error"]["code"] == "weight_updates_off"
        assert "allow_weight_updates=true" in r.json()["error"]["message"]
        assert (
            _generate(srv.url, input_ids=[[1, 2]], sampling_params={"max_tokens": 1}).status_code
            == 200
        )


def test_api_key_guards_every_rl_route(engine):
    settings = ServeSettings(api_key="k3y", allow_weight_updates=True)
    with ServerThread(create_app(engine, settings)) as srv:
        for path in (*OPT_IN, "/generate"):
            assert httpx.post(srv.url + path, json={}).status_code == 401, path
        assert httpx.get(srv.url + "/get_weight_version").status_code == 401
        key = {"authorization": "Bearer k3y"}
        r = httpx.get(srv.url + "/get_weight_version", headers=key)
        assert r.status_code == 200
        r = httpx.post(srv.url + "/pause_generation", headers=key)
        assert r.status_code == 200
        r = httpx.post(srv.url + "/continue_generation", headers={"x-api-key": "k3y"})
        assert r.status_code == 200
    with ServerThread(create_app(engine, ServeSettings(api_key="k3y"))) as srv:
        r = httpx.post(srv.url + "/update_weights_from_disk", json={})
        assert r.status_code == 403  # off: refused whatever the key


def test_pause_holds_new_requests_until_continue(rl_server, rl_engine):
    url = rl_server.url
    gate = rl_server.server.config.app.state.rl_gate
    before = rl_engine.get_stats()["total_tasks"]
    assert httpx.post(url + "/pause_generation").json()["success"] is True
    answer: dict = {}

    def send() -> None:
        body = {"input_ids": [[3, 4]], "sampling_params": {"max_tokens": 3, "temperature": 0}}
        answer["r"] = httpx.post(url + "/generate", json=body, timeout=120)

    t = threading.Thread(target=send)
    t.start()
    deadline = time.monotonic() + 60
    while gate.waiting == 0:  # the request has arrived and waits at the gate
        assert time.monotonic() < deadline
        time.sleep(0.01)
    stats = rl_engine.get_stats()
    assert stats["active_tasks"] == 0 and stats["waiting_queue"] == 0
    assert "r" not in answer and httpx.get(url + "/health").status_code == 200
    assert rl_engine.get_stats()["total_tasks"] == before  # nothing reached the engine
    assert httpx.post(url + "/continue_generation").status_code == 200
    t.join(timeout=120)
    r = answer["r"]
    assert r.status_code == 200 and len(r.json()["outputs"][0]["output_ids"]) == 3
    ref = rl_engine.run_batch([[3, 4]], max_tokens=3, temperature=0)
    assert r.json()["outputs"][0]["output_ids"] == ref[0]


def test_sampling_params_travel_through_the_client_unchanged():
    from astrai.remote.wire import params_from_json, params_to_json

    params = SamplingParams(
        temperature=0.7,
        top_p=0.9,
        top_k=5,
        max_tokens=9,
        n=2,
        stop_ids=frozenset({3, 1}),
        logit_bias={4: -1.5},
        logprobs_mode="scaled",
        ignore_eos=True,
    )
    wire = json.loads(json.dumps(params_to_json(params)))
    assert params_from_json(wire, seed=None) == params
    with pytest.raises(ValueError, match="logits_processors"):
        params_to_json(SamplingParams(logits_processors=[lambda ids, row: row]))


def test_allow_weight_updates_comes_from_the_config_and_is_checked():
    from serve_helpers import serve_config

    from astrai.serve.__main__ import settings_of

    cfg = serve_config(["model_path=/x", "allow_weight_updates=true"])
    assert settings_of(cfg).allow_weight_updates is True
    assert settings_of(serve_config(["model_path=/x"])).allow_weight_updates is False
    with pytest.raises(SystemExit, match="allow_weight_updates: must be true or false"):
        settings_of(serve_config(["model_path=/x", "allow_weight_updates=yes"]))
