"""`/update_weights_from_disk` on a served engine (astrai.serve.weight_updates): new
weights from a `save_pretrained` directory or a PEFT adapter directory, checked against an
engine built on those weights; refused updates (names, shapes, dtypes, versions) keep the
old weights and version. The distributed path: tests/remote/test_weight_sender.py."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import httpx
import pytest
import torch
from lora_helpers import make_adapter
from safetensors.torch import save_file
from tiny_parts import TINY_SHAPE

from astrai.inference import InferenceEngine, SamplingParams
from astrai.model import AutoModel, save_pretrained
from astrai.serve import ServerThread, ServeSettings, create_app

PROMPTS = [[5, 17, 30, 2], [40, 41, 42]]
GREEDY = SamplingParams(temperature=0, max_tokens=6)
SAMPLED = SamplingParams(temperature=1.0, max_tokens=6, n=2)


def perturbed(model_dir: Path, out: Path, seed: int) -> Path:
    """The model of `model_dir` with every parameter moved by seeded noise, saved to `out`."""
    model = AutoModel.from_pretrained(model_dir)
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    return save_pretrained(model, out)


def engine_on(path: Path, tokenizer) -> InferenceEngine:
    return InferenceEngine(
        AutoModel.from_pretrained(path),
        tokenizer,
        max_batch_size=8,
        max_seq_len=256,
        batch_invariant=True,
    )


def generate(url: str, params: SamplingParams, seed: int = 7) -> list:
    from astrai.remote import ReplicaClient

    client = ReplicaClient(url)
    try:
        return [(r.token_ids, r.logprobs) for r in client.generate(PROMPTS, params, seed=seed)]
    finally:
        client.close()


def run_batch(engine: InferenceEngine, params: SamplingParams, seed: int = 7) -> list:
    out = engine.run_batch(PROMPTS, params, seed=seed, return_details=True)
    return [(r.token_ids, r.logprobs) for r in out]


def update(url: str, **body) -> httpx.Response:
    return httpx.post(url + "/update_weights_from_disk", json=body, timeout=120)


@pytest.fixture
def served(model_dir, tokenizer):
    """A fresh engine on the tiny model behind a server with weight updates on."""
    engine = engine_on(model_dir, tokenizer)
    with ServerThread(create_app(engine, ServeSettings(allow_weight_updates=True))) as srv:
        yield srv.url, engine
    engine.shutdown()


def test_update_from_disk_equals_an_engine_on_those_weights(served, model_dir, tokenizer, tmp_path):
    url, _ = served
    new_dir = perturbed(model_dir, tmp_path / "w1", seed=1)
    before = generate(url, GREEDY)
    r = update(url, model_path=str(new_dir), policy_version=1)
    assert r.status_code == 200, r.text
    assert r.json() == {"success": True, "policy_version": 1}
    assert r.headers["x-policy-version"] == "1"
    ref = engine_on(new_dir, tokenizer)
    try:
        for params in (GREEDY, SAMPLED):
            assert generate(url, params) == run_batch(ref, params)
    finally:
        ref.shutdown()
    assert generate(url, GREEDY) != before  # the update changed something
    assert httpx.get(url + "/get_weight_version").json() == {"policy_version": 1}


def _write(path: Path, state: dict) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    save_file(state, str(path / "model.safetensors"))
    return path


@pytest.mark.parametrize("case", ["shape", "name", "dtype", "version", "missing"])
def test_a_refused_update_keeps_the_old_weights(served, model_dir, tmp_path, case):
    url, engine = served
    good = {
        k: v.contiguous()
        for k, v in AutoModel.from_pretrained(perturbed(model_dir, tmp_path / "w", 2))
        .state_dict()
        .items()
    }
    last = sorted(good)[-1]  # the last tensor is the bad one: nothing before it is written
    version, param, needle = 1, None, ""
    if case == "shape":
        good[last] = torch.zeros(3, 3)
        param, needle = (
            "shapes",
            f"{last} has shape [{', '.join(map(str, engine.model.state_dict()[last].shape))}] in the model, got [3, 3]",
        )
    elif case == "name":
        good["layers.9.mlp.up_proj.weight"] = torch.zeros(2)
        param, needle = "names", "layers.9.mlp.up_proj.weight is not a tensor of the model"
    elif case == "dtype":
        good[last] = good[last].to(torch.bfloat16)
        param, needle = "dtypes", f"{last} is float32 in the model, got bfloat16"
    elif case == "version":
        version, param, needle = (
            0,
            "policy_version",
            "0 is not greater than the replica's current version 0",
        )
    path = _write(tmp_path / "bad", good)
    if case == "missing":
        path, param, needle = tmp_path / "nowhere", "model_path", "is not a directory"
    before = generate(url, SAMPLED)
    r = update(url, model_path=str(path), policy_version=version)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and needle in error["message"], error
    assert engine.policy_version == 0
    assert r.headers["x-policy-version"] == "0"
    assert generate(url, SAMPLED) == before


def test_tied_embeddings_update_the_head_too(tmp_path, save_model_dir, stdlib_tokenizer):
    """A tied model's `save_pretrained` directory has no `lm_head.weight`: the embedding
    it does have is the head as well."""
    base = save_model_dir(
        tmp_path / "tied", stdlib_tokenizer, tie_word_embeddings=True, **TINY_SHAPE
    )
    new_dir = perturbed(base, tmp_path / "tied-new", seed=3)
    engine = engine_on(base, stdlib_tokenizer)
    ref = engine_on(new_dir, stdlib_tokenizer)
    try:
        with ServerThread(create_app(engine, ServeSettings(allow_weight_updates=True))) as srv:
            assert update(srv.url, model_path=str(new_dir), policy_version=5).status_code == 200
            assert engine.model.lm_head.weight is engine.model.embed_tokens.weight
            assert generate(srv.url, SAMPLED) == run_batch(ref, SAMPLED)
    finally:
        engine.shutdown()
        ref.shutdown()


def _lora_engine(model_dir, tokenizer, adapter: Path) -> InferenceEngine:
    engine = InferenceEngine(
        AutoModel.from_pretrained(model_dir),
        tokenizer,
        max_batch_size=8,
        max_seq_len=256,
        lora={"max_loras": 2, "max_lora_rank": 8},
    )
    engine.load_adapter("a", adapter)
    return engine


def test_lora_update_from_disk_equals_a_server_started_with_those_weights(
    model_dir, tokenizer, tmp_path
):
    """`lora_name`: the loaded adapter's A and B are replaced; outputs then equal an engine
    that loaded the new adapter directory itself (one prompt group: LoRA engines are not
    batch invariant, a group alone is exact)."""
    first = make_adapter(model_dir, tmp_path / "first", r=4, seed=1)
    second = make_adapter(model_dir, tmp_path / "second", r=4, seed=2)
    other_rank = make_adapter(model_dir, tmp_path / "r2", r=2, seed=3)
    engine = _lora_engine(model_dir, tokenizer, first)
    ref = _lora_engine(model_dir, tokenizer, second)
    params = SamplingParams(temperature=1.0, max_tokens=6, n=3, adapter="a")
    try:
        with ServerThread(create_app(engine, ServeSettings(allow_weight_updates=True))) as srv:
            from astrai.remote import ReplicaClient

            client = ReplicaClient(srv.url)
            base_before = client.generate([PROMPTS[0]], GREEDY, seed=1)
            r = update(srv.url, model_path=str(other_rank), policy_version=1, lora_name="a")
            assert r.status_code == 400 and "rank 2" in r.json()["error"]["message"]
            r = update(srv.url, model_path=str(second), policy_version=1, lora_name="b")
            assert r.status_code == 400 and r.json()["error"]["param"] == "lora_name"
            assert client.update_weights_from_disk(str(second), 1, lora_name="a") == 1
            got = client.generate([PROMPTS[0]], params, seed=4)
            want = ref.run_batch([PROMPTS[0]], params, seed=4, return_details=True)
            assert [(g.token_ids, g.logprobs) for g in got] == [
                (w.token_ids, w.logprobs) for w in want
            ]
            # the base model is untouched by an adapter's update
            assert client.generate([PROMPTS[0]], GREEDY, seed=1) == base_before
            client.close()
    finally:
        engine.shutdown()
        ref.shutdown()


def test_an_update_while_paused_serves_the_waiting_request_on_the_new_version(
    model_dir, tokenizer, tmp_path
):
    """The trainer's sequence: pause, update, continue. A request that arrives while paused
    asking for the new version waits at the gate (unchecked), the update leaves the gate
    closed, and after continue the request runs on the new weights."""
    new_dir = perturbed(model_dir, tmp_path / "w", seed=4)
    engine = engine_on(model_dir, tokenizer)
    ref = engine_on(new_dir, tokenizer)
    app = create_app(engine, ServeSettings(allow_weight_updates=True))
    gate = app.state.rl_gate
    answer: dict = {}
    try:
        with ServerThread(app) as srv:
            assert httpx.post(srv.url + "/pause_generation").status_code == 200
            body = {
                "input_ids": PROMPTS,
                "sampling_params": {"max_new_tokens": 6, "temperature": 0},  # SGLang's name
                "seed": 7,
                "policy_version": 1,
            }
            waiting = threading.Thread(
                target=lambda: answer.update(
                    r=httpx.post(srv.url + "/generate", json=body, timeout=120)
                )
            )
            waiting.start()
            deadline = time.monotonic() + 60
            while gate.waiting == 0:
                assert time.monotonic() < deadline
                time.sleep(0.01)
            assert update(srv.url, model_path=str(new_dir), policy_version=1).status_code == 200
            assert gate.waiting == 1 and "r" not in answer  # still paused after the update
            assert httpx.post(srv.url + "/continue_generation").status_code == 200
            waiting.join(timeout=120)
        r = answer["r"]
        assert r.status_code == 200, r.text
        assert r.json()["policy_version"] == 1
        assert [(o["output_ids"], o["logprobs"]) for o in r.json()["outputs"]] == run_batch(
            ref, GREEDY
        )
    finally:
        engine.shutdown()
        ref.shutdown()
