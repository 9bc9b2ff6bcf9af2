"""A tiny model served over real HTTP (uvicorn on 127.0.0.1, a free port).

`ScriptedTransformer` is a real `Transformer` whose `forward_packed` can be told to force a
token sequence: while `script` is set, the logits of every sampling row put all the mass
on the next scripted token (then on `<|im_end|>`). Everything else - scheduler, KV pool,
sampling, detokenizer, HTTP, SDKs - runs for real, so tool-call and stop-string tests are
deterministic without mocking the engine. The row's position in the script is its
sequence length minus the prompt length, recorded when the row is prefilled (contiguous
KV mode, no prefix cache, so a prefill always starts at position 0).
"""

from __future__ import annotations

import time
from pathlib import Path

import anthropic
import openai
import pytest
from tiny_parts import TINY_SHAPE

from astrai.inference import InferenceEngine
from astrai.model import AutoModel, Transformer
from astrai.serve import ServerThread, ServeSettings, create_app
from astrai.tokenizer import AutoTokenizer


class ScriptedTransformer(Transformer):
    script: list[int] | None = None
    step_delay: float = 0.0  # seconds each forward sleeps: a race a test wants the engine to lose

    def forward_packed(self, input_ids, positions, kv_cache, logits_indices=None, **kwargs):
        if self.step_delay:
            time.sleep(self.step_delay)
        logits = super().forward_packed(input_ids, positions, kv_cache, logits_indices, **kwargs)
        script = self.script
        if script is None or logits_indices is None:
            return logits
        starts = self.__dict__.setdefault("_prompt_len", {})
        ends, pos = [], 0
        for q in kv_cache.q_lens_host:
            pos += q
            ends.append(pos - 1)
        sampled = set(logits_indices.tolist())
        forced = logits.new_full(logits.shape, -1e4)
        k = 0
        for row, seq, q, end in zip(
            kv_cache.req_pool_indices_host, kv_cache.seq_lens_host, kv_cache.q_lens_host, ends
        ):
            if seq == q:  # prefill from position 0: a new sequence in this row
                starts[row] = seq
            if end not in sampled:
                continue
            i = seq - starts[row]
            forced[k, script[i] if i < len(script) else self.end_id] = 1e4
            k += 1
        return forced


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory, save_model_dir, stdlib_tokenizer) -> Path:
    return save_model_dir(
        tmp_path_factory.mktemp("tiny-model"),
        stdlib_tokenizer,
        max_position_embeddings=1024,
        **TINY_SHAPE,
    )


@pytest.fixture(scope="session")
def tokenizer(model_dir) -> AutoTokenizer:
    return AutoTokenizer.from_pretrained(model_dir)


def scripted_engine(model_dir: Path, tokenizer: AutoTokenizer, end: str) -> InferenceEngine:
    """An engine over `model_dir`'s weights as a `ScriptedTransformer` whose scripts end with
    the token `end` (the caller shuts it down)."""
    loaded = AutoModel.from_pretrained(model_dir)
    model = ScriptedTransformer(loaded.config)
    model.load_state_dict(loaded.state_dict())
    model.eval()
    model.end_id = tokenizer.token_to_id(end)
    return InferenceEngine(
        model, tokenizer, max_batch_size=16, max_seq_len=1024, cache_mode="contiguous"
    )


@pytest.fixture(scope="session")
def make_scripted_engine():
    """`scripted_engine`, for a test module with a tokenizer (and chat template) of its own."""
    return scripted_engine


@pytest.fixture(scope="session")
def engine(model_dir, tokenizer):
    eng = scripted_engine(model_dir, tokenizer, "<|im_end|>")
    yield eng
    eng.shutdown()


@pytest.fixture
def script(engine, tokenizer):
    """`script("text")` forces the model to answer exactly `text` (then <|im_end|>)."""

    def set_script(text: str | None) -> None:
        engine.model.script = None if text is None else tokenizer.encode(text)

    yield set_script
    engine.model.script = None


@pytest.fixture
def slow_steps(engine):
    """`slow_steps(s)`: every forward sleeps `s` seconds (reset after the test), so that a
    long answer outlasts a client's timeout however fast the engine is."""

    def set_delay(seconds: float) -> None:
        engine.model.step_delay = seconds

    yield set_delay
    engine.model.step_delay = 0.0


@pytest.fixture(scope="session")
def server(engine):
    with ServerThread(create_app(engine, ServeSettings())) as srv:
        yield srv


@pytest.fixture(scope="session")
def base_url(server) -> str:
    return server.url


@pytest.fixture
def oai(base_url) -> openai.OpenAI:
    with openai.OpenAI(base_url=f"{base_url}/v1", api_key="x", max_retries=0, timeout=60) as c:
        yield c


@pytest.fixture
def aoai(base_url) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key="x", max_retries=0, timeout=60)


@pytest.fixture
def ant(base_url) -> anthropic.Anthropic:
    with anthropic.Anthropic(base_url=base_url, api_key="x", max_retries=0, timeout=60) as c:
        yield c


@pytest.fixture
def aant(base_url) -> anthropic.AsyncAnthropic:
    return anthropic.AsyncAnthropic(base_url=base_url, api_key="x", max_retries=0, timeout=60)


@pytest.fixture
def in_process(monkeypatch):
    """`serve(cfg)` (python -m astrai.serve) run in this process: keep this process's torch
    threads and root log level."""
    import logging

    import astrai.runtime

    monkeypatch.setattr(astrai.runtime, "set_threads", lambda threads: None)
    root = logging.getLogger()
    level = root.level
    yield
    root.setLevel(level)


@pytest.fixture(scope="session")
def dense_logprobs(engine):
    """`dense_logprobs(ids)` -> `[len(ids), vocab]` log_softmax of the model's dense training
    forward (no KV cache, no engine): the independent reference for served log-probs."""
    import torch

    def run(ids: list[int]):
        with torch.no_grad():
            logits = Transformer.forward(engine.model, torch.tensor([ids]))[0]
        return torch.log_softmax(logits.float(), dim=-1)

    return run
