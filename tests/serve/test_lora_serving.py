"""Many LoRA adapters over one base, served as vLLM serves them: `model` picks the adapter
(OpenAI chat and completions, Anthropic messages), adapters of one burst share the engine,
`/v1/models` lists them with their parent, and `/v1/load_lora_adapter` /
`/v1/unload_lora_adapter` (mounted with `allow_runtime_lora`) change them while other
streams keep going; a client loads only from inside `allowed_lora_roots` and never
unloads or replaces the adapters the operator started with."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import anthropic
import httpx
import openai
import pytest
from lora_helpers import SlowTransformer, make_adapter, make_foreign_adapter
from serve_helpers import wait_idle

from astrai.inference import InferenceEngine
from astrai.model import AutoModel
from astrai.serve import ServerThread, ServeSettings, create_app
from astrai.serve.adapters import RUNTIME_LORA_OFF, ServedModels

BASE = "base"
PROMPT = "def main(args):"
MESSAGES = [{"role": "user", "content": "import sys"}]


@pytest.fixture(scope="module")
def adapter_dirs(model_dir, tmp_path_factory, tokenizer) -> dict:
    root = tmp_path_factory.mktemp("adapters")
    return {
        "a": make_adapter(model_dir, root / "a", r=4, seed=1),
        "b": make_adapter(model_dir, root / "b", r=8, seed=2),
        "c": make_adapter(model_dir, root / "c", r=2, seed=3),
        "big": make_adapter(model_dir, root / "big", r=32, seed=4),
        "foreign": make_foreign_adapter(root / "foreign", len(tokenizer)),
    }


@pytest.fixture(scope="module")
def lora_engine(model_dir, tokenizer, adapter_dirs):
    loaded = AutoModel.from_pretrained(model_dir)
    model = SlowTransformer(loaded.config)
    model.load_state_dict(loaded.state_dict())
    model.eval()
    eng = InferenceEngine(
        model,
        tokenizer,
        max_batch_size=8,
        max_seq_len=512,
        cache_mode="contiguous",
        lora={"max_loras": 4, "max_lora_rank": 16},
    )
    for name in ("a", "b"):
        eng.load_adapter(name, adapter_dirs[name])
    yield eng
    eng.shutdown()


def runtime_settings(root, **kw) -> ServeSettings:
    """A server whose clients may load adapters from inside `root`."""
    return ServeSettings(
        model_name=BASE, allow_runtime_lora=True, allowed_lora_roots=(str(root),), **kw
    )


@pytest.fixture(scope="module")
def root(adapter_dirs):
    """The directory clients may load adapters from (every adapter of `adapter_dirs`)."""
    return adapter_dirs["a"].parent


@pytest.fixture(scope="module")
def lora_server(lora_engine, root):
    with ServerThread(create_app(lora_engine, runtime_settings(root))) as srv:
        yield srv


@pytest.fixture
def slow(lora_engine):
    """`slow(s)`: every forward sleeps `s` seconds (reset after the test)."""

    def set_delay(seconds: float) -> None:
        lora_engine.model.step_delay = seconds

    yield set_delay
    lora_engine.model.step_delay = 0.0


@pytest.fixture
def client(lora_server):
    with openai.OpenAI(
        base_url=f"{lora_server.url}/v1", api_key="x", max_retries=0, timeout=60
    ) as c:
        yield c


@pytest.fixture
def ant_client(lora_server):
    with anthropic.Anthropic(base_url=lora_server.url, api_key="x", max_retries=0, timeout=60) as c:
        yield c


def no_stop_bias(tokenizer) -> dict[int, float]:
    """A logit bias that bans the stop tokens: generation runs to `max_tokens`."""
    return {i: -100.0 for i in tokenizer.stop_ids}


def alone(engine, ids: list[int], adapter: str | None, max_tokens: int, **extra) -> list[int]:
    """Greedy tokens of `ids` with `adapter`, the engine running nothing else."""
    wait_idle(engine)
    (out,) = engine.run_batch(
        [ids], temperature=0.0, max_tokens=max_tokens, adapter=adapter, **extra
    )
    return list(out)


def chat_ids(tokenizer, messages) -> list[int]:
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)


def post(server, path: str, body: dict, **kw) -> httpx.Response:
    return httpx.post(server.url + path, json=body, timeout=60, **kw)


def test_models_lists_adapters_with_their_parent(lora_server, client, adapter_dirs, root):
    r = httpx.get(lora_server.url + "/v1/models")
    data = r.json()["data"]
    cards = {m["id"]: m for m in data}
    assert list(cards)[:1] == [BASE] and {"a", "b"} <= set(cards)
    assert cards[BASE]["parent"] is None
    for name in ("a", "b"):
        assert cards[name]["parent"] == BASE
        assert cards[name]["root"] == name  # never the server's directory
        assert cards[name]["object"] == "model"
    assert str(root) not in r.text and "/tmp" not in r.text
    got = client.models.retrieve("a")
    assert got.id == "a" and got.model_extra["parent"] == BASE
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("no-such-adapter")


def test_concurrent_adapters_match_each_alone(lora_engine, tokenizer, client, ant_client, slow):
    """One burst mixing the base and two adapters over three protocols: each answer is the
    greedy answer of its adapter run alone, and the adapters really differ."""
    ids = tokenizer.encode(PROMPT)
    chat = chat_ids(tokenizer, MESSAGES)
    n = 10
    want = {m: alone(lora_engine, ids, m, n) for m in (None, "a", "b")}
    assert len({tuple(v) for v in want.values()}) == 3, "the adapters change nothing"
    want_chat = {m: alone(lora_engine, chat, m, n) for m in ("a", "b")}
    text = {k: tokenizer.decode(v) for k, v in want.items()}

    def completion(model: str) -> tuple[str, str]:
        r = client.completions.create(model=model, prompt=PROMPT, max_tokens=n, temperature=0)
        return r.model, r.choices[0].text

    def chat_completion(model: str) -> tuple[str, str]:
        r = client.chat.completions.create(
            model=model, messages=MESSAGES, max_tokens=n, temperature=0
        )
        return r.model, r.choices[0].message.content

    def message(model: str) -> tuple[str, str]:
        r = ant_client.messages.create(
            model=model, messages=MESSAGES, max_tokens=n, extra_body={"temperature": 0}
        )
        return r.model, "".join(b.text for b in r.content)

    jobs = [
        (completion, BASE),
        (completion, "a"),
        (completion, "b"),
        (chat_completion, "a"),
        (message, "b"),
        (completion, "a"),
    ]
    slow(0.02)  # every request spans many steps: they run in the same batches
    with ThreadPoolExecutor(len(jobs)) as pool:
        got = list(pool.map(lambda job: job[0](job[1]), jobs))
    assert got[0] == (BASE, text[None])
    assert got[1] == ("a", text["a"]) and got[5] == ("a", text["a"])
    assert got[2] == ("b", text["b"])
    assert got[3] == ("a", tokenizer.decode(want_chat["a"], skip_special_tokens=True))
    assert got[4] == ("b", tokenizer.decode(want_chat["b"], skip_special_tokens=True))


def test_unknown_model_is_a_404_in_each_protocol(lora_server, client, ant_client):
    with pytest.raises(openai.NotFoundError) as err:
        client.chat.completions.create(model="nope", messages=MESSAGES, max_tokens=2)
    assert err.value.body["message"] == "The model `nope` does not exist."
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt=PROMPT, max_tokens=2)
    with pytest.raises(anthropic.NotFoundError):
        ant_client.messages.create(model="nope", messages=MESSAGES, max_tokens=2)
    r = post(lora_server, "/v1/chat/completions", {"model": "nope", "messages": MESSAGES})
    assert r.status_code == 404
    assert r.json()["error"] == {
        "message": "The model `nope` does not exist.",
        "type": "not_found_error",
        "param": "model",
        "code": "model_not_found",
    }
    r = post(lora_server, "/v1/messages", {"model": "nope", "messages": MESSAGES, "max_tokens": 2})
    assert r.status_code == 404 and r.json()["type"] == "error"
    assert r.json()["error"]["type"] == "not_found_error"
    # no `model` at all, or the served name: the base model
    r = post(lora_server, "/v1/completions", {"prompt": PROMPT, "max_tokens": 2})
    assert r.status_code == 200 and r.json()["model"] == BASE


def test_load_and_unload_while_a_stream_runs(
    lora_server, lora_engine, tokenizer, adapter_dirs, client, ant_client, slow
):
    lora_engine.load_adapter("c", adapter_dirs["c"])
    ids = tokenizer.encode(PROMPT)
    bias = no_stop_bias(tokenizer)
    n = 24
    want = tokenizer.decode(alone(lora_engine, ids, "a", n, logit_bias=bias))
    slow(0.03)
    stream = client.completions.create(
        model="a",
        prompt=PROMPT,
        max_tokens=n,
        temperature=0,
        stream=True,
        logit_bias={str(k): v for k, v in bias.items()},
    )
    chunks = iter(stream)
    text = next(chunks).choices[0].text
    assert lora_engine.get_stats()["active_tasks"] == 1  # the stream is still generating
    r = post(
        lora_server,
        "/v1/load_lora_adapter",
        {"lora_name": "d", "lora_path": str(adapter_dirs["b"])},
    )
    assert r.status_code == 200, r.text
    assert r.text == "Success: LoRA adapter 'd' added successfully."
    r = post(lora_server, "/v1/unload_lora_adapter", {"lora_name": "c"})
    assert r.status_code == 200, r.text
    assert r.text == "Success: LoRA adapter 'c' removed successfully."
    assert lora_engine.get_stats()["active_tasks"] == 1  # ... and still is
    text += "".join(c.choices[0].text for c in chunks)
    assert text == want
    slow(0.0)

    listed = [m.id for m in client.models.list()]
    assert "d" in listed and "c" not in listed
    got = client.completions.create(model="d", prompt=PROMPT, max_tokens=6, temperature=0)
    assert got.choices[0].text == tokenizer.decode(alone(lora_engine, ids, "b", 6))
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="c", prompt=PROMPT, max_tokens=2)
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="c", messages=MESSAGES, max_tokens=2)
    with pytest.raises(anthropic.NotFoundError):
        ant_client.messages.create(model="c", messages=MESSAGES, max_tokens=2)
    r = post(lora_server, "/v1/unload_lora_adapter", {"lora_name": "c"})
    assert r.status_code == 404 and "'c'" in r.json()["error"]["message"]
    wait_idle(lora_engine)
    assert post(lora_server, "/v1/unload_lora_adapter", {"lora_name": "d"}).status_code == 200


def test_unload_of_an_adapter_in_use_is_refused(lora_server, lora_engine, tokenizer, client, slow):
    body = {"lora_name": "e", "lora_path": "b"}  # relative: inside the first root
    assert post(lora_server, "/v1/load_lora_adapter", body).status_code == 200
    bias = no_stop_bias(tokenizer)
    slow(0.03)
    stream = client.completions.create(
        model="e",
        prompt=PROMPT,
        max_tokens=20,
        temperature=0,
        stream=True,
        logit_bias={str(k): v for k, v in bias.items()},
    )
    chunks = iter(stream)
    next(chunks)
    r = post(lora_server, "/v1/unload_lora_adapter", {"lora_name": "e"})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "lora_name" and err["code"] == "adapter_in_use"
    assert "'e'" in err["message"]
    assert sum(1 for _ in chunks) >= 1  # the stream finishes normally
    slow(0.0)
    assert "e" in [m.id for m in client.models.list()]
    wait_idle(lora_engine)
    assert post(lora_server, "/v1/unload_lora_adapter", {"lora_name": "e"}).status_code == 200


def test_load_errors_name_the_file_and_the_limit(lora_server, adapter_dirs, root):
    def load(name: str, path) -> dict:
        r = post(lora_server, "/v1/load_lora_adapter", {"lora_name": name, "lora_path": str(path)})
        assert r.status_code == 400, r.text
        return r.json()["error"]

    missing = root / "no-such-adapter"  # inside the root: the operator's files, named
    assert str(missing) in load("x", missing)["message"]
    err = load("x", adapter_dirs["big"])["message"]
    assert "adapter_config.json" in err and "max_lora_rank" in err and "16" in err
    err = load("x", adapter_dirs["foreign"])["message"]
    assert "adapter_model.safetensors" in err and "32" in err
    err = load("a", adapter_dirs["b"])  # a duplicate name
    assert err["param"] == "lora_name" and "'a'" in err["message"]
    err = load(BASE, adapter_dirs["b"])  # the base model's own name
    assert err["param"] == "lora_name"
    r = post(lora_server, "/v1/load_lora_adapter", {"lora_name": "x"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "lora_path"
    r = post(lora_server, "/v1/unload_lora_adapter", {"lora_name": "never-loaded"})
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"
    listed = httpx.get(lora_server.url + "/v1/models").json()["data"]
    assert "x" not in [m["id"] for m in listed]


def test_registry_full_names_the_limit(model_dir, tokenizer, adapter_dirs, root):
    loaded = AutoModel.from_pretrained(model_dir)
    eng = InferenceEngine(
        loaded,
        tokenizer,
        max_batch_size=2,
        max_seq_len=128,
        cache_mode="contiguous",
        lora={"max_loras": 1, "max_lora_rank": 8, "max_cpu_loras": 1},
    )
    try:
        with ServerThread(create_app(eng, runtime_settings(root))) as srv:
            ok = {"lora_name": "a", "lora_path": str(adapter_dirs["a"])}
            assert post(srv, "/v1/load_lora_adapter", ok).status_code == 200
            r = post(srv, "/v1/load_lora_adapter", {**ok, "lora_name": "c"})
            assert r.status_code == 400 and "max_cpu_loras" in r.json()["error"]["message"]
    finally:
        eng.shutdown()


def test_load_and_unload_need_the_api_key(lora_engine, adapter_dirs, root):
    settings = runtime_settings(root, api_key="sesame")
    with ServerThread(create_app(lora_engine, settings)) as srv:
        body = {"lora_name": "keyed", "lora_path": str(adapter_dirs["c"])}
        assert post(srv, "/v1/load_lora_adapter", body).status_code == 401
        key = {"Authorization": "Bearer sesame"}
        assert post(srv, "/v1/load_lora_adapter", body, headers=key).status_code == 200
        gone = {"lora_name": "keyed"}
        assert post(srv, "/v1/unload_lora_adapter", gone).status_code == 401
        r = post(srv, "/v1/unload_lora_adapter", gone, headers={"x-api-key": "sesame"})
        assert r.status_code == 200


def test_runtime_loading_is_off_unless_the_operator_allows_it(base_url, lora_engine, root):
    """Without `allow_runtime_lora` the routes are not mounted (vLLM's default): a 404 that
    says how the operator turns them on, also over an engine that serves adapters."""
    with ServerThread(create_app(lora_engine, ServeSettings(model_name=BASE))) as srv:
        for url in (base_url, srv.url):
            for path, body in (
                ("/v1/load_lora_adapter", {"lora_name": "t", "lora_path": str(root / "a")}),
                ("/v1/unload_lora_adapter", {"lora_name": "a"}),
            ):
                r = httpx.post(url + path, json=body)
                assert r.status_code == 404, r.text
                assert r.json()["error"]["message"] == RUNTIME_LORA_OFF
        assert "t" not in [m["id"] for m in httpx.get(srv.url + "/v1/models").json()["data"]]
        assert "a" in [m["id"] for m in httpx.get(srv.url + "/v1/models").json()["data"]]


def test_a_server_without_lora_says_how_to_enable_it(engine, root):
    """Runtime loading allowed over an engine without LoRA: load is refused with the fix,
    and any model name still reaches the base model, as before."""
    with ServerThread(create_app(engine, runtime_settings(root))) as srv:
        body = {"lora_name": "a", "lora_path": "a"}
        r = httpx.post(srv.url + "/v1/load_lora_adapter", json=body)
        assert r.status_code == 400
        message = r.json()["error"]["message"]
        assert "lora_modules" in message and "engine.lora" in message
        r = httpx.post(srv.url + "/v1/unload_lora_adapter", json={"lora_name": "a"})
        assert r.status_code == 400
        with openai.OpenAI(base_url=f"{srv.url}/v1", api_key="x", max_retries=0) as oai:
            got = oai.completions.create(model="anything", prompt=PROMPT, max_tokens=2)
        assert got.choices[0].text is not None


def test_an_adapter_unloaded_after_resolution_is_a_404(lora_server, client, monkeypatch):
    """An unload between the name check and the submission: the engine's refusal is the
    same 404, for one prompt and for a batch of prompts."""
    monkeypatch.setattr(ServedModels, "resolve", lambda self, body: "ghost")
    for prompt in (PROMPT, [PROMPT, "x = 1"]):
        with pytest.raises(openai.NotFoundError) as err:
            client.completions.create(model="ghost", prompt=prompt, max_tokens=2)
        assert "`ghost`" in err.value.body["message"]


def test_a_path_outside_the_roots_is_refused_alike(lora_server, root, tmp_path):
    """The issue's reproduction: `/etc` answered "file not found: /etc/adapter_config.json"
    (an existence oracle). Now every path outside the roots gets one answer, whether it
    exists or not, a `..` or a symlink leading out of the root included."""
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "adapter_config.json").write_text("{}")
    link = root / "escape"
    if not link.is_symlink():
        link.symlink_to(outside, target_is_directory=True)
    answers = set()
    for path in (
        "/etc",
        "/no/such/dir",
        str(outside),
        str(tmp_path / "missing"),
        str(root / ".." / "outside"),
        "../../etc",
        str(link),
        "escape",
    ):
        r = post(lora_server, "/v1/load_lora_adapter", {"lora_name": "t", "lora_path": path})
        assert r.status_code == 400, (path, r.text)
        err = r.json()["error"]
        assert err["param"] == "lora_path" and err["code"] == "lora_path_not_allowed"
        answer = err["message"].replace(repr(path), "<path>")  # the client's own path echoed
        assert "adapter_config" not in answer and str(root) not in answer
        answers.add(answer)
    assert len(answers) == 1, answers
    assert "t" not in [m["id"] for m in httpx.get(lora_server.url + "/v1/models").json()["data"]]


def test_the_operators_adapters_cannot_be_unloaded_or_replaced(
    lora_server, lora_engine, tokenizer, client
):
    """The issue's swap: unload a2, then load a2 from a1's directory. `a` and `b` were loaded
    before the app was built (as `lora_modules` are): unloading them is refused, so their
    names cannot be taken over, and they still answer with their own weights."""
    ids = tokenizer.encode(PROMPT)
    want = tokenizer.decode(alone(lora_engine, ids, "b", 6))
    r = post(lora_server, "/v1/unload_lora_adapter", {"lora_name": "b"})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["code"] == "adapter_pinned"
    r = post(lora_server, "/v1/load_lora_adapter", {"lora_name": "b", "lora_path": "a"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "lora_name"
    got = client.completions.create(model="b", prompt=PROMPT, max_tokens=6, temperature=0)
    assert got.choices[0].text == want


@pytest.mark.parametrize(
    ("name", "why"),
    [
        ("../a", "not a path"),
        ("a/b", "not a path"),
        ("a\\b", "not a path"),
        ("x" * 129, "at most 128"),
        ("bell\x07", "unprintable"),
        ("new\nline", "unprintable"),
        ("policy", "live adapter"),
    ],
)
def test_a_bad_lora_name_is_a_400_naming_it(lora_server, name, why):
    body = {"lora_name": name, "lora_path": "c"}
    r = post(lora_server, "/v1/load_lora_adapter", body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "lora_name" and why in err["message"], err
    assert name not in [m["id"] for m in httpx.get(lora_server.url + "/v1/models").json()["data"]]
