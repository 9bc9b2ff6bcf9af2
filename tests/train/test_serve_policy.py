"""serve_policy (astrai.train.serve_policy): the run's engine answers the OpenAI API between
optimizer steps.

The training runs are `astrai.train` itself, in process (tiny_pretrain at test size; also
with `callbacks=eval`, and tiny_grpo), with a probe callback loaded through `+callbacks.probe._target_=test_serve_policy.Probe`. Before
step K the probe sends its requests with the real `openai` client from client threads and
waits until they are held at the gate; inside the step it checks they are still unanswered
and that the engine's loop is not running; after the step (its `on_train_batch_end` runs
after the PolicyServer's, which answered them) it takes the responses. The references are
independent: `astrai.serve`'s own `build_engine` + `create_app` over the export of step K,
and a run without serve_policy.
"""

from __future__ import annotations

import hashlib
import json
import logging
import socket
import threading
from concurrent.futures import Future
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import httpx
import openai
import pytest
import torch
from lightning.pytorch.callbacks import Callback
from train_helpers import SMALL, TINY_GRPO_EVAL, TINY_MODEL, checkpoint_differences
from train_helpers import train_run as run_in_process

from astrai.train.serve_policy import PolicyServer, PolicyServeSettings, serve_policy_problems

STEPS = 3
# tiny_grpo at test size (as tests/train/test_grpo.py), with its eval callback: the rollout
# engine serves, the evaluation callback keeps its own
GRPO_RUN = [*TINY_GRPO_EVAL, "callbacks.model_checkpoint.every_n_train_steps=1"]
RUN = [
    *TINY_MODEL,
    *SMALL,
    "debug=fast",  # 3 steps, a validation after step 2 (the gate stays shut through it)
    "callbacks.progress_bar=null",
    "callbacks.model_checkpoint.every_n_train_steps=1",  # last.ckpt of the final step
]
KEY = "sk-policy-test"

# One request per step, so that the live engine and the reference compute each alone (a
# batch of other size could round differently).
PLAN: dict[int, list[dict[str, Any]]] = {
    1: [{"kind": "completions", "prompt": "def main(", "temperature": 1.0, "seed": 7}],
    2: [{"kind": "chat_stream", "prompt": "import os", "temperature": 0.9, "seed": 11}],
    3: [{"kind": "chat", "prompt": "class Foo:", "temperature": 0.0}],
}
# For the bit-for-bit run: several requests at once, unseeded and seeded, one without the key.
BUSY_PLAN: dict[int, list[dict[str, Any]]] = {
    k: [
        {"kind": "completions", "prompt": "for i in", "temperature": 1.0},
        {"kind": "chat_stream", "prompt": "return", "temperature": 1.0, "seed": k},
        {"kind": "completions", "prompt": "x", "temperature": 1.0, "key": None},
    ]
    for k in range(1, STEPS + 1)
}
# One request far longer than serve_policy.max_window_s allows.
# (The probe bans the end-of-text tokens with logit_bias: nothing but the cut ends it.)
LONG_PLAN = {1: [{"kind": "completions", "prompt": "def", "max_tokens": 900, "no_stop": True}]}
PLANS = {"single": PLAN, "busy": BUSY_PLAN, "long": LONG_PLAN}


# ---------------------------------------------------------------------- client side
def ask(url: str, model: str, spec: dict[str, Any]) -> dict[str, Any]:
    """One request through the `openai` SDK: the text, its tokens' log-probs, every
    system_fingerprint it carried, the finish reason; or the HTTP status of an error."""
    client = openai.OpenAI(
        base_url=f"{url}/v1", api_key=spec.get("key", KEY) or "wrong", max_retries=0, timeout=120
    )
    extra = {k: spec[k] for k in ("temperature", "seed", "logit_bias") if k in spec}
    extra["max_tokens"] = spec.get("max_tokens", 8)
    try:
        if spec["kind"] == "completions":
            r = client.completions.create(model=model, prompt=spec["prompt"], logprobs=1, **extra)
            c = r.choices[0]
            out = {"text": c.text, "logprobs": c.logprobs.token_logprobs}
            out["tokens"] = r.usage.completion_tokens
            return {**out, "fingerprints": [r.system_fingerprint], "finish": c.finish_reason}
        messages = [{"role": "user", "content": spec["prompt"]}]
        if spec["kind"] == "chat":
            r = client.chat.completions.create(
                model=model, messages=messages, logprobs=True, **extra
            )
            c = r.choices[0]
            out = {"text": c.message.content, "logprobs": [t.logprob for t in c.logprobs.content]}
            return {**out, "fingerprints": [r.system_fingerprint], "finish": c.finish_reason}
        text, logprobs, prints, finish = [], [], [], None
        for chunk in client.chat.completions.create(
            model=model, messages=messages, stream=True, logprobs=True, **extra
        ):
            prints.append(chunk.system_fingerprint)
            for c in chunk.choices:
                text.append(c.delta.content or "")
                logprobs += [t.logprob for t in (c.logprobs.content if c.logprobs else None) or []]
                finish = c.finish_reason or finish
        out = {"text": "".join(text), "logprobs": logprobs}
        return {**out, "fingerprints": prints, "finish": finish}
    except openai.APIStatusError as err:
        return {"status": err.status_code}


def _ask_into(future: Future, url: str, model: str, spec: dict[str, Any]) -> None:
    try:
        future.set_result(ask(url, model, spec))
    except BaseException as err:  # the test shows it, instead of waiting for a result
        future.set_exception(err)


def engine_kind(trainer, pl_module, engine) -> str:
    """Whose engine serves: GRPO's rollout engine, the eval callback's, or serve_policy's own."""
    from astrai.train.evaluation import EvalCallback

    if engine is getattr(pl_module, "engine", None):
        return "grpo"
    if any(isinstance(c, EvalCallback) and c.engine is engine for c in trainer.callbacks):
        return "eval"
    return "own"


def rng_digest() -> str:
    return hashlib.sha256(torch.get_rng_state().numpy().tobytes()).hexdigest()


class Probe(Callback):
    """Sends the plan's requests before step K, checks them during it, takes them after it;
    writes what it saw to `out` (JSON) at teardown."""

    def __init__(self, out: str, plan: str = "single", fail_at: int | None = None) -> None:
        self.out = Path(out)
        self.plan = PLANS[plan]
        self.fail_at = fail_at  # raise inside this optimizer step
        self.pending: list[Future] = []
        self.seen: dict[str, Any] = {"steps": {}, "engine_calls": []}
        self.server: PolicyServer | None = None

    def setup(self, trainer, pl_module, stage) -> None:
        found = [c for c in trainer.callbacks if isinstance(c, PolicyServer)]
        self.server = found[0] if found else None
        if self.server is not None:  # its window must come before this probe's batch end
            assert trainer.callbacks.index(self.server) < trainer.callbacks.index(self)
        model = pl_module.model

        def record(module, args) -> None:  # which thread runs the model, in which mode
            engine = threading.current_thread().name.startswith("astrai-engine")
            self.seen["engine_calls"].append([engine, module.training, trainer.validating])

        model.embed_tokens.register_forward_pre_hook(record)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        step = trainer.global_step + 1  # the optimizer step about to run
        server = self.server
        if server is None or step not in self.plan:
            return
        row = self.seen["steps"].setdefault(str(step), {})
        row["rng_before"] = rng_digest()
        self.seen["url"], self.seen["model"] = server.url, server.settings.model_name
        for spec in self.plan[step]:
            if spec.get("no_stop"):
                spec = {**spec, "logit_bias": {i: -100 for i in pl_module.tokenizer.stop_ids}}
            future: Future = Future()
            args = (future, server.url, self.seen["model"], spec)
            threading.Thread(target=_ask_into, args=args, daemon=True).start()
            self.pending.append(future)
        row["held"] = server.gate.wait_for_waiting(len(self.plan[step]), timeout=60)
        # GETs are not held: the run's name, and the engine reported paused during the step
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0)
        row["models"] = [m.id for m in client.models.list()]
        row["health"] = httpx.get(f"{server.url}/health").status_code

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        if self.pending:
            row = self.seen["steps"][str(trainer.global_step + 1)]
            row["answered_during_step"] = any(f.done() for f in self.pending)
            row["engine_running_during_step"] = self.server.engine.running
        if trainer.global_step + 1 == self.fail_at:
            raise RuntimeError(f"probe: step {self.fail_at} fails")

    def on_exception(self, trainer, pl_module, exception) -> None:
        # after the PolicyServer's on_exception: what the requests held by this step got
        if self.pending:
            row = self.seen["steps"][str(trainer.global_step + 1)]
            row["responses"] = [f.result(timeout=60) for f in self.pending]
        self.out.write_text(json.dumps(self.seen))

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if not self.pending:
            return
        row = self.seen["steps"][str(trainer.global_step)]
        row["responses"] = [f.result(timeout=120) for f in self.pending]
        row["rng_after"] = rng_digest()
        row["engine"] = engine_kind(trainer, pl_module, self.server.engine)
        row["model_training_after"] = pl_module.model.training
        self.pending = []

    def teardown(self, trainer, pl_module, stage) -> None:
        self.out.write_text(json.dumps(self.seen))


# ---------------------------------------------------------------------- training runs
def train_run(where: Path, data_dir: Path, extra: list[str], base: list[str] = RUN) -> Path:
    """`astrai.train` in this process with the test-size settings; returns the run folder."""
    return run_in_process(where, data_dir, extra, base)


def serving(where: Path, plan: str, *settings: str) -> list[str]:
    return [
        "serve_policy.port=0",
        f"serve_policy.api_key={KEY}",
        *settings,
        "+callbacks.probe._target_=test_serve_policy.Probe",
        f"+callbacks.probe.out={where / 'probe.json'}",
        f"+callbacks.probe.plan={plan}",
    ]


def serving_threads() -> set[int]:
    """The live server and engine-loop threads of this process (other tests of the session
    may leave their own daemons: only the ones a run adds count)."""
    names = ("astrai-http", "astrai-engine")
    return {t.ident for t in threading.enumerate() if t.name in names and t.ident is not None}


def port_closed(url: str) -> bool:
    parsed = urlparse(url)
    with socket.socket() as sock:
        sock.settimeout(2)
        return sock.connect_ex((parsed.hostname, parsed.port)) != 0


@pytest.fixture(scope="module")
def served(tmp_path_factory, data_dir, monkeypatch_module) -> tuple[Path, dict[str, Any]]:
    """A run that served PLAN (exports every step), and what its probe saw."""
    where = tmp_path_factory.mktemp("served")
    before = serving_threads()
    run = train_run(
        where,
        data_dir,
        [*serving(where, "single"), "callbacks.export.every_n_train_steps=1"],
    )
    left = serving_threads() - before  # taken right after fit, before any reference server
    return run, {**json.loads((where / "probe.json").read_text()), "threads_left": len(left)}


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("WANDB_MODE", "offline")
        mp.setenv("HF_HUB_OFFLINE", "1")
        yield mp


# ---------------------------------------------------------------------- tests
def test_requests_wait_for_the_step_and_match_astrai_serve_on_its_export(served) -> None:
    """Each request sent before step K is held through the step (engine loop stopped), is
    answered right after it with system_fingerprint policy-step-K, and its text equals, byte
    for byte, what `astrai.serve` answers over the export of step K (its log-probs too)."""
    from astrai.serve import ServerThread, create_app
    from astrai.serve.__main__ import build_engine, settings_of

    run, seen = served
    assert sorted(seen["steps"]) == [str(k) for k in PLAN]
    for k, specs in PLAN.items():
        row = seen["steps"][str(k)]
        assert row["held"], f"step {k}: the request never reached the gate"
        assert row["models"] == ["tiny_pretrain"] and row["health"] == 503
        assert not row["answered_during_step"], f"step {k}: answered while the step ran"
        assert not row["engine_running_during_step"], f"step {k}: engine loop ran in the step"
        assert row["rng_after"] == row["rng_before"], f"step {k}: serving moved the global RNG"
        assert row["model_training_after"], f"step {k}: the policy was left in eval mode"
        export = run / "export" / f"step{k:06d}"
        cfg = {
            "model_path": str(export),
            "model_name": seen["model"],
            "device": "auto",  # where the trainer ran (accelerator auto)
            # the sizes of the engine serve_policy built (its oneDNN layouts follow them)
            "engine": {
                "_target_": "astrai.inference.InferenceEngine",
                "_partial_": True,
                "max_batch_size": PolicyServeSettings().max_batch_size,
            },
        }
        engine = build_engine(cfg)  # astrai.serve's own
        try:
            with ServerThread(create_app(engine, settings_of(cfg))) as reference:
                for spec, got in zip(specs, row["responses"], strict=True):
                    assert set(got["fingerprints"]) == {f"policy-step-{k}"}, got
                    want = ask(reference.url, seen["model"], {**spec, "key": None})
                    assert want["fingerprints"][0] is None  # only the live policy names one
                    assert got["text"].encode() == want["text"].encode(), (k, spec)
                    # the same tokens' log-probs, to the last bits of a reduction's rounding
                    # (a step moves them by ~1e-1)
                    assert len(got["logprobs"]) == 8
                    assert got["logprobs"] == pytest.approx(want["logprobs"], rel=1e-6, abs=0)
                    assert got["finish"] == want["finish"]
        finally:
            engine.shutdown()
    # the engine ran only in eval mode, the training forward only in train mode
    calls = seen["engine_calls"]
    assert any(engine for engine, _, _ in calls) and any(not engine for engine, _, _ in calls)
    assert not [c for c in calls if c[0] and c[1]], "the engine ran the policy in train mode"
    assert all(training for engine, training, val in calls if not engine and not val)
    # the server is down after fit: its port is closed and no server thread is left
    assert port_closed(seen["url"])
    assert seen["threads_left"] == 0


def test_served_run_ends_with_the_same_weights_as_an_unserved_one(
    tmp_path, data_dir, monkeypatch_module, caplog
) -> None:
    """Bit for bit: LoRA dropout draws from the global RNG every step, so a request that
    moved it (or left the policy in eval mode) would change the final weights."""
    lora = ["strategy.lora={r: 4, lora_alpha: 8, lora_dropout: 0.2}"]
    caplog.set_level(logging.INFO, logger="astrai.train.serve_policy")
    busy = tmp_path / "busy"
    served = train_run(busy, data_dir, [*lora, *serving(busy, "busy")])
    seen = json.loads((busy / "probe.json").read_text())
    plain = train_run(tmp_path / "plain", data_dir, lora)
    assert "serving the live policy at http://127.0.0.1:" in caplog.text
    check_busy(seen, "own")
    assert not checkpoint_differences(served, plain, STEPS)


@pytest.mark.slow
def test_grpo_serves_from_its_rollout_engine_and_trains_the_same(
    tmp_path, data_dir, monkeypatch_module
) -> None:
    """GRPO: the rollout engine serves (versioned by the optimizer step, as GRPO versions
    it), rollouts and evaluation on the training thread are untouched, and the run ends
    with the weights of a run without serve_policy, bit for bit."""
    busy = tmp_path / "busy"
    served = train_run(busy, data_dir, serving(busy, "busy"), base=GRPO_RUN)
    check_busy(json.loads((busy / "probe.json").read_text()), "grpo")
    plain = train_run(tmp_path / "plain", data_dir, [], base=GRPO_RUN)
    assert not checkpoint_differences(served, plain, STEPS)


def test_the_eval_callbacks_engine_serves_when_there_is_no_rollout_engine(
    tmp_path, data_dir, monkeypatch_module
) -> None:
    """callbacks=eval: one engine per run, the evaluation callback's (built at its first use).
    Each window served an unseeded request at temperature 1 (its noise comes from torch's
    global RNG), and a pretraining step draws nothing: the RNG is the same after the window."""
    evaluating = [
        "callbacks=eval",
        "callbacks.eval.every_n_steps=2",
        "callbacks.eval.suites.arithmetic.num_prompts=4",
        "callbacks.eval.suites.arithmetic.max_tokens=8",
    ]
    busy = tmp_path / "busy"
    train_run(busy, data_dir, [*evaluating, *serving(busy, "busy")])
    seen = json.loads((busy / "probe.json").read_text())
    check_busy(seen, "eval")
    assert all(row["rng_after"] == row["rng_before"] for row in seen["steps"].values())


def test_a_failing_step_stops_serving_and_refuses_the_waiting_requests(
    tmp_path, data_dir, monkeypatch_module
) -> None:
    """An exception in step 2: the requests held by it get a 503 (not a hang), the port
    closes and no server or engine thread is left."""
    failing = [*serving(tmp_path, "busy"), "+callbacks.probe.fail_at=2"]
    before = serving_threads()
    with pytest.raises(RuntimeError, match="probe: step 2 fails"):
        train_run(tmp_path, data_dir, failing)
    seen = json.loads((tmp_path / "probe.json").read_text())
    assert [r.get("status") for r in seen["steps"]["1"]["responses"]] == [None, None, 401]
    assert [r.get("status") for r in seen["steps"]["2"]["responses"]] == [503, 503, 503]
    assert port_closed(seen["url"])
    assert not serving_threads() - before


def test_a_request_past_max_window_s_is_cut_short_and_training_goes_on(
    tmp_path, data_dir, monkeypatch_module, caplog
) -> None:
    caplog.set_level(logging.WARNING, logger="astrai.train.serve_policy")
    long = [*serving(tmp_path, "long", "serve_policy.max_window_s=0.05"), "trainer.max_steps=2"]
    train_run(tmp_path, data_dir, long)
    (got,) = json.loads((tmp_path / "probe.json").read_text())["steps"]["1"]["responses"]
    assert got["fingerprints"] == ["policy-step-1"]
    assert got["finish"] == "length" and 0 < got["tokens"] < 900, got
    assert "still open after max_window_s=0.05; cutting them short" in caplog.text


def check_busy(seen: dict[str, Any], engine: str) -> None:
    for k in BUSY_PLAN:
        row = seen["steps"][str(k)]
        assert row["held"] and not row["engine_running_during_step"]
        assert row["engine"] == engine
        responses = row["responses"]
        assert [r.get("status") for r in responses] == [None, None, 401]  # the key is required
        assert all(set(r["fingerprints"]) == {f"policy-step-{k}"} for r in responses[:2])


def test_settings_are_checked_and_naming_the_key() -> None:
    with pytest.raises(ValueError, match=r"serve_policy\.prot: unknown setting"):
        PolicyServeSettings.parse({"prot": 8000})
    with pytest.raises(ValueError, match=r"serve_policy\.port: .*'8000'"):
        PolicyServeSettings.parse({"port": "8000"})
    with pytest.raises(ValueError, match=r"serve_policy\.max_batch_size"):
        PolicyServeSettings.parse({"port": 0, "max_batch_size": 0})
    with pytest.raises(ValueError, match=r"serve_policy\.max_window_s"):
        PolicyServeSettings.parse({"port": 0, "max_window_s": 0})
    assert PolicyServeSettings.parse({"port": 0, "max_window_s": None}).max_window_s is None


def test_off_without_a_port() -> None:
    """`settings` None or `port: null`: every hook returns at once (no trainer needed)."""
    for settings in (None, {"port": None, "host": "127.0.0.1"}):
        server = PolicyServer(settings)
        assert not server.enabled
        server.setup(None, None, "fit")  # type: ignore[arg-type]
        server.on_train_start(None, None)  # type: ignore[arg-type]
        assert server.serve_waiting(None) == 0  # type: ignore[arg-type]
        server.teardown(None, None, "fit")  # type: ignore[arg-type]
        assert server.server is None and server.url is None


def test_busy_port_fails_before_training_naming_the_key() -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        port = sock.getsockname()[1]

        class Trainer:  # what setup reads
            is_global_zero = True

        with pytest.raises(ValueError, match=rf"serve_policy\.port={port}: cannot listen"):
            PolicyServer({"port": port}).setup(Trainer(), None, "fit")  # type: ignore[arg-type]


def test_exposed_host_needs_a_key_or_an_explicit_yes() -> None:
    with pytest.raises(ValueError, match=r"^serve_policy\.host=0\.0\.0\.0: reachable from other"):
        PolicyServeSettings.parse({"port": 0, "host": "0.0.0.0"})
    with pytest.raises(ValueError, match=r"^serve_policy\.port: must be an int .*'abc'"):
        PolicyServeSettings.parse({"port": "abc"})
    assert PolicyServeSettings.parse({"port": 0, "host": "0.0.0.0", "api_key": "k"}).api_key
    yes = {"port": 0, "host": "0.0.0.0", "allow_unauthenticated": True}
    assert PolicyServeSettings.parse(yes).allow_unauthenticated


def test_problems_name_the_key_in_one_line_each() -> None:
    assert serve_policy_problems(None) == []
    assert serve_policy_problems({"port": None, "host": "0.0.0.0"}) == []
    assert serve_policy_problems({"port": "abc"}) == [
        "serve_policy.port: must be an int in [0, 65535], got 'abc'"
    ]
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        port = sock.getsockname()[1]
        (problem,) = serve_policy_problems({"port": port})
    assert problem.startswith(f"serve_policy.port={port}: cannot listen")
    assert "another serve_policy.port=<n>" in problem


def test_the_live_policy_server_mounts_no_adapter_routes(monkeypatch) -> None:
    """Nothing on a training run's server loads or unloads adapters (POSTs to those paths
    are 404s); llguidance's tokenizer is built with the app, not by a first request."""
    import llguidance
    from fastapi.testclient import TestClient

    from astrai.inference import InferenceEngine
    from astrai.model import ModelConfig, Transformer
    from astrai.serve.adapters import RUNTIME_LORA_PATHS
    from astrai.tokenizer import AutoTokenizer

    make = llguidance.LLTokenizer
    built = []
    monkeypatch.setattr(llguidance, "LLTokenizer", lambda *a, **k: built.append(1) or make(*a, **k))
    tokenizer = AutoTokenizer.train(["def f(x):\n    return x + 1\n" * 8], vocab_size=300)
    config = ModelConfig(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
    )
    engine = InferenceEngine(Transformer(config), tokenizer, start=False, max_batch_size=2)
    try:
        app = PolicyServer({"port": 0}).build_app(engine)
        assert built == [1]
        paths = {getattr(route, "path", None) for route in app.routes}
        assert "/v1/chat/completions" in paths
        assert not paths & set(RUNTIME_LORA_PATHS)
        with TestClient(app) as client:
            models = client.get("/v1/models").json()
            assert [m["id"] for m in models["data"]] == ["astrai-policy"]
    finally:
        engine.shutdown()


@pytest.mark.slow  # a subprocess composing the training config (no data, no model)
def test_training_command_names_a_busy_port_before_it_starts(tmp_path: Path) -> None:
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[2]
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        port = sock.getsockname()[1]
        for arg, line in (
            (f"serve_policy.port={port}", f"serve_policy.port={port}: cannot listen"),
            ("serve_policy.port=abc", "serve_policy.port: must be an int in [0, 65535]"),
        ):
            p = subprocess.run(
                [sys.executable, "-m", "astrai.train", arg, f"hydra.run.dir={tmp_path / 'run'}"],
                cwd=root,
                capture_output=True,
                text=True,
                timeout=300,
            )
            log = p.stdout + p.stderr
            assert p.returncode != 0 and line in log, log[-3000:]
            assert "Traceback" not in log and "nothing was run" in log
    assert not (tmp_path / "run").exists()  # before the run folder, data or model
