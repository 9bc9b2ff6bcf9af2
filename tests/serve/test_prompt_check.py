"""The server has no prompt check of its own: the engine's (`InferenceEngine.check_request`,
`max_prompt_tokens` included) refuses a prompt, and each protocol answers that refusal as
a 400 naming its own field (`messages`, `prompt`, `prompt[1]` in a completions batch)."""

from __future__ import annotations

import anthropic
import httpx
import openai
import pytest
from serve_helpers import served_engine_like

from astrai.inference import InferenceEngine, RequestRejected, SamplingParams
from astrai.serve import ProtocolHandler, ServeSettings

CAP = 24
WORD = "self "  # one token of the test tokenizer


@pytest.fixture(scope="module")
def capped(engine):
    """A server whose engine caps prompts at CAP tokens; the server itself is told nothing."""
    with served_engine_like(engine, max_prompt_tokens=CAP) as served:
        yield served


def engine_reason(eng: InferenceEngine, ids: list[int]) -> str:
    with pytest.raises(RequestRejected) as info:
        eng.check_request(ids, SamplingParams(max_tokens=2))
    assert info.value.param == "prompt"
    return str(info.value)


def test_the_handler_checks_no_prompt_itself():
    assert not hasattr(ProtocolHandler, "_check_limits")
    assert "max_prompt_tokens" not in ServeSettings.__dataclass_fields__  # the engine's setting


@pytest.mark.parametrize("stream", [False, True])
def test_chat_prompt_over_the_engine_cap_is_a_400_naming_messages(capped, tokenizer, stream):
    eng, url = capped
    messages = [{"role": "user", "content": WORD * CAP}]
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    with openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=60) as client:
        with pytest.raises(openai.BadRequestError) as info:
            client.chat.completions.create(
                model="astrai", messages=messages, max_tokens=2, stream=stream
            )
        err = info.value
        assert err.status_code == 400 and err.param == "messages"
        assert err.code == "context_length_exceeded"
        assert err.body["message"] == f"messages: {engine_reason(eng, ids)}"
        assert f"the limit is {CAP} (max_prompt_tokens)" in err.body["message"]
        short = [{"role": "user", "content": "hi"}]  # under the cap: answered
        assert client.chat.completions.create(model="astrai", messages=short, max_tokens=2)


def test_completions_names_the_prompt_and_its_index(capped):
    eng, url = capped
    long = [5] * (CAP + 1)
    with openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=60) as client:
        with pytest.raises(openai.BadRequestError) as info:
            client.completions.create(model="astrai", prompt=long, max_tokens=2)
        assert info.value.param == "prompt"
        assert info.value.body["message"] == f"prompt: {engine_reason(eng, long)}"
        queued = eng.get_stats()["total_tasks"]
        with pytest.raises(openai.BadRequestError) as info:
            client.completions.create(model="astrai", prompt=[[5, 6], long], max_tokens=2)
        assert info.value.param == "prompt"
        assert info.value.body["message"] == f"prompt[1]: {engine_reason(eng, long)}"
        assert info.value.code == "context_length_exceeded"
        # every prompt of a batch is checked before any is queued: prompt 0 never ran
        assert eng.get_stats()["total_tasks"] == queued
        exact = client.completions.create(model="astrai", prompt=[5] * CAP, max_tokens=2)
        assert exact.usage.prompt_tokens == CAP  # the cap itself is allowed


def test_anthropic_prompt_over_the_engine_cap_is_a_400(capped):
    _, url = capped
    body = {
        "model": "astrai",
        "max_tokens": 2,
        "messages": [{"role": "user", "content": WORD * CAP}],
    }
    r = httpx.post(f"{url}/v1/messages", json=body, timeout=60)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert error["message"].startswith("messages: prompt is too long:"), error
    with (
        anthropic.Anthropic(base_url=url, api_key="x", max_retries=0, timeout=60) as client,
        pytest.raises(anthropic.BadRequestError, match="max_prompt_tokens"),
    ):
        client.messages.create(**body)


def test_without_a_cap_the_same_prompt_is_served(oai):
    """The session server's engine has no cap: nothing in the server refuses the prompt."""
    messages = [{"role": "user", "content": WORD * CAP}]
    reply = oai.chat.completions.create(model="astrai", messages=messages, max_tokens=2)
    assert reply.usage.prompt_tokens > CAP


def test_the_cli_cap_goes_to_the_engine(model_dir):
    """`python -m astrai.serve max_prompt_tokens=N`: checked before the model loads, then an
    engine setting (the server keeps no copy)."""
    from astrai.serve.__main__ import build_engine, settings_of

    cfg = {
        "model_path": str(model_dir),
        "device": "cpu",
        "max_prompt_tokens": 8,
        "engine": {
            "_target_": "astrai.inference.InferenceEngine",
            "_partial_": True,
            "cache_mode": "contiguous",
            "max_batch_size": 2,
            "max_seq_len": 64,
        },
    }
    settings_of(cfg)
    with pytest.raises(SystemExit, match="max_prompt_tokens: must be a positive int"):
        settings_of({**cfg, "max_prompt_tokens": 0})
    eng = build_engine(cfg)
    try:
        assert eng.max_prompt_tokens == 8
    finally:
        eng.shutdown()
    eng = build_engine({**cfg, "max_prompt_tokens": None})
    try:
        assert eng.max_prompt_tokens is None
    finally:
        eng.shutdown()
