"""OpenAI chat `logprobs` / `top_logprobs`, parsed by the real `openai` SDK and compared with
the log_softmax of the model's dense forward over the prompt and the generated tokens."""

import httpx
import openai
import pytest

MSGS = [{"role": "user", "content": "Tell me about the import system"}]


def _ids_of(entries, tokenizer) -> list[int]:
    """Token ids of the entries, from their bytes (every token's bytes are unique here)."""
    from astrai.serve.logprobs import TokenText

    tt = TokenText(tokenizer)
    by_bytes = {tt.bytes(i): i for i in range(len(tokenizer))}
    assert len(by_bytes) == len(tokenizer)
    return [by_bytes[bytes(e.bytes)] for e in entries]


def _check_against_dense(entries, prompt, tokenizer, dense_logprobs, k):
    ids = _ids_of(entries, tokenizer)
    ref = dense_logprobs(prompt + ids)
    for pos, (e, tok) in enumerate(zip(entries, ids)):
        row = ref[len(prompt) - 1 + pos]
        assert e.logprob == pytest.approx(row[tok].item(), abs=1e-4)
        assert e.token == tokenizer.decode([tok]) or e.token.startswith("bytes:")
        tops = e.top_logprobs
        assert len(tops) == k
        assert [t.logprob for t in tops] == sorted((t.logprob for t in tops), reverse=True)
        values, top_ids = row.topk(k)
        assert [t.logprob for t in tops] == pytest.approx(values.tolist(), abs=1e-4)
        assert _ids_of(tops, tokenizer) == top_ids.tolist()
    return ids


@pytest.fixture
def prompt(tokenizer) -> list[int]:
    return tokenizer.apply_chat_template(MSGS, add_generation_prompt=True, tokenize=True)


@pytest.mark.parametrize("temperature", [0.0, 1.3])
def test_plain(oai, tokenizer, dense_logprobs, prompt, temperature):
    r = oai.chat.completions.create(
        model="astrai",
        messages=MSGS,
        max_tokens=12,
        temperature=temperature,
        seed=7,
        logprobs=True,
        top_logprobs=2,
    )
    content = r.choices[0].logprobs.content
    assert r.choices[0].logprobs.refusal is None
    assert len(content) == r.usage.completion_tokens  # every generated token, the end too
    ids = _check_against_dense(content, prompt, tokenizer, dense_logprobs, 2)
    assert tokenizer.decode(ids, skip_special_tokens=True) == r.choices[0].message.content
    if temperature == 0:  # greedy: the chosen token is the top alternative
        assert all(e.token == e.top_logprobs[0].token for e in content)


def test_stream_matches_plain(oai, tokenizer, dense_logprobs, prompt):
    kwargs = dict(model="astrai", messages=MSGS, max_tokens=12, temperature=0, logprobs=True)
    plain = oai.chat.completions.create(top_logprobs=2, **kwargs).choices[0]
    chunks = list(oai.chat.completions.create(stream=True, top_logprobs=2, **kwargs))
    text, entries = "", []
    for c in chunks:
        if not c.choices:
            continue
        ch = c.choices[0]
        text += ch.delta.content or ""
        if ch.logprobs is not None:
            entries += ch.logprobs.content
        # the entries never run ahead of the text they belong to
        sent = b"".join(bytes(e.bytes) for e in entries).decode(errors="ignore")
        assert text.startswith(sent.replace("<|im_end|>", "")), (text, sent)
    assert text == plain.message.content
    assert [(e.token, e.logprob) for e in entries] == [
        (e.token, e.logprob) for e in plain.logprobs.content
    ]
    _check_against_dense(entries, prompt, tokenizer, dense_logprobs, 2)
    # The SDK's stream helper sees them as events and accumulates them in its snapshot
    # (its get_final_completion refuses finish_reason "length", which 12 tokens end with).
    with oai.chat.completions.stream(top_logprobs=2, **kwargs) as stream:
        done = [e.content for e in stream if e.type == "logprobs.content.done"]
        snapshot = stream.current_completion_snapshot
    want = [e.logprob for e in plain.logprobs.content]
    assert [e.logprob for e in done[0]] == want
    assert [e.logprob for e in snapshot.choices[0].logprobs.content] == want


def test_top_logprobs_zero_and_stop(oai, tokenizer, dense_logprobs, prompt, script):
    """`logprobs=True` alone: no alternatives. A stop string ends the entries at its token."""
    r = oai.chat.completions.create(
        model="astrai", messages=MSGS, max_tokens=6, temperature=0, logprobs=True
    )
    content = r.choices[0].logprobs.content
    assert content and all(e.top_logprobs == [] for e in content)
    script("alpha beta gamma delta")
    r = oai.chat.completions.create(
        model="astrai", messages=MSGS, max_tokens=30, logprobs=True, stop=" gamma"
    )
    assert r.choices[0].message.content == "alpha beta"
    text = "".join(e.token for e in r.choices[0].logprobs.content)
    assert text.startswith("alpha beta") and "delta" not in text


def test_without_logprobs_is_null(oai):
    r = oai.chat.completions.create(model="astrai", messages=MSGS, max_tokens=2)
    assert r.choices[0].logprobs is None


@pytest.mark.parametrize(
    "extra, param",
    [
        ({"top_logprobs": 2}, "top_logprobs"),
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ],
)
def test_bad_top_logprobs(base_url, oai, extra, param):
    body = {"messages": MSGS, "max_tokens": 2, **extra}
    r = httpx.post(base_url + "/v1/chat/completions", json=body, timeout=30)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and param in err["message"]
    assert err["type"] == "invalid_request_error"
    with pytest.raises(openai.BadRequestError, match="top_logprobs"):
        oai.chat.completions.create(model="astrai", messages=MSGS, max_tokens=2, **extra)
