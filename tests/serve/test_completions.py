"""Legacy `/v1/completions` through the real `openai` SDK: prompt forms, n, stop, stream,
echo and log-probs (compared with the log_softmax of the model's dense forward)."""

import json
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import openai
import pytest
from server_process import free_port, wait_healthy

ROOT = Path(__file__).resolve().parents[2]

PROMPT = "import os\nimport sys\n\ndef main("
OTHER = "class Path:\n    def __init__(self"


def _greedy(dense_logprobs, ids: list[int], steps: int) -> list[int]:
    out = []
    for _ in range(steps):
        out.append(int(dense_logprobs(ids + out)[-1].argmax()))
    return out


def _create(oai, **kwargs):
    return oai.completions.create(model="astrai", **kwargs)


def test_text_prompt_is_greedy_continuation(oai, tokenizer, dense_logprobs):
    r = _create(oai, prompt=PROMPT, max_tokens=6, temperature=0)
    assert r.object == "text_completion" and r.id.startswith("cmpl-")
    ids = tokenizer.encode(PROMPT)
    expected = tokenizer.decode(_greedy(dense_logprobs, ids, 6), skip_special_tokens=True)
    assert r.choices[0].text == expected
    assert r.choices[0].logprobs is None
    assert r.choices[0].finish_reason in ("length", "stop")
    assert r.usage.prompt_tokens == len(ids)
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_prompt_forms_and_n(oai, tokenizer):
    a, b = tokenizer.encode(PROMPT), tokenizer.encode(OTHER)
    base = dict(max_tokens=4, temperature=0)
    by_text = [c.text for c in _create(oai, prompt=[PROMPT, OTHER], **base).choices]
    assert by_text == [c.text for c in _create(oai, prompt=[a, b], **base).choices]
    assert by_text[0] == _create(oai, prompt=a, **base).choices[0].text
    r = _create(oai, prompt=[PROMPT, OTHER], n=2, **base)
    assert [c.index for c in r.choices] == [0, 1, 2, 3]  # prompt_index * n + j
    assert [c.text for c in r.choices] == [by_text[0]] * 2 + [by_text[1]] * 2
    assert r.usage.prompt_tokens == len(a) + len(b)


def test_n_sampled_choices_differ(oai):
    r = _create(oai, prompt=PROMPT, max_tokens=12, n=2, seed=3, temperature=1.5)
    assert r.choices[0].text != r.choices[1].text


def test_echo_logprobs_equal_dense_forward(oai, tokenizer, dense_logprobs):
    ids = tokenizer.encode(PROMPT)
    r = _create(oai, prompt=PROMPT, max_tokens=0, echo=True, logprobs=3)
    choice = r.choices[0]
    assert choice.text == PROMPT and choice.finish_reason == "length"
    lp = choice.logprobs
    assert len(lp.tokens) == len(ids) == len(lp.token_logprobs) == len(lp.text_offset)
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    ref = dense_logprobs(ids)
    for pos in range(1, len(ids)):
        want = ref[pos - 1]
        assert lp.token_logprobs[pos] == pytest.approx(want[ids[pos]].item(), abs=1e-5)
        top = lp.top_logprobs[pos]
        values = want.topk(3).values.tolist()
        assert sorted(top.values(), reverse=True)[:3] == pytest.approx(values, abs=1e-5)
        assert lp.token_logprobs[pos] in top.values()  # the chosen token is always listed
        assert PROMPT[lp.text_offset[pos] :].startswith(lp.tokens[pos])
    assert "".join(lp.tokens) == PROMPT and r.usage.completion_tokens == 0


def test_echo_with_one_generated_token_is_what_lm_eval_reads(oai, tokenizer, dense_logprobs):
    """lm-eval's `local-completions` sends echo, max_tokens=1, logprobs=1, temperature 0 and
    reads `token_logprobs[ctxlen:-1]`: the prompt's entries, then one generated token."""
    ids = tokenizer.encode(OTHER)
    r = _create(oai, prompt=[ids], max_tokens=1, echo=True, logprobs=1, temperature=0)
    lp = r.choices[0].logprobs
    assert len(lp.token_logprobs) == len(ids) + 1
    ref = dense_logprobs(ids)
    greedy = int(ref[-1].argmax())
    assert lp.token_logprobs[-1] == pytest.approx(ref[-1, greedy].item(), abs=1e-5)
    assert lp.token_logprobs[-1] == max(lp.top_logprobs[-1].values())  # lm-eval's greedy test
    for pos in range(1, len(ids)):
        is_argmax = int(ref[pos - 1].argmax()) == ids[pos]
        assert (lp.token_logprobs[pos] == max(lp.top_logprobs[pos].values())) == is_argmax


def test_stream_matches_plain(oai, tokenizer):
    kwargs = dict(prompt=[PROMPT, OTHER], max_tokens=8, temperature=0, logprobs=2, echo=True)
    plain = _create(oai, **kwargs)
    texts, tokens, lps, offsets = {0: "", 1: ""}, {0: [], 1: []}, {0: [], 1: []}, {0: [], 1: []}
    finish = {}
    chunks = list(_create(oai, stream=True, stream_options={"include_usage": True}, **kwargs))
    for c in chunks:
        assert c.object == "text_completion"
        for ch in c.choices:
            texts[ch.index] += ch.text
            if ch.logprobs is not None:
                tokens[ch.index] += ch.logprobs.tokens
                lps[ch.index] += ch.logprobs.token_logprobs
                offsets[ch.index] += ch.logprobs.text_offset
            if ch.finish_reason:
                finish[ch.index] = ch.finish_reason
    for c in plain.choices:
        assert texts[c.index] == c.text
        assert tokens[c.index] == c.logprobs.tokens
        assert lps[c.index] == pytest.approx(c.logprobs.token_logprobs)
        assert offsets[c.index] == c.logprobs.text_offset
        assert finish[c.index] == c.finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.total_tokens == plain.usage.total_tokens


def _offsets_point_into_the_text(text: str, lp, special: set[str]) -> None:
    """Every token starts at its `text_offset` in `text`; a special token the text leaves
    out sits where it would be; no offset points past the text."""
    assert len(lp.text_offset) == len(lp.tokens)
    assert lp.text_offset == sorted(lp.text_offset)
    assert all(0 <= off <= len(text) for off in lp.text_offset), (lp.text_offset, len(text))
    for token, off in zip(lp.tokens, lp.text_offset):
        if token in special and not text[off:].startswith(token):
            continue
        assert text[off:].startswith(token), (token, off, text)


@pytest.mark.parametrize("stream", [False, True])
def test_text_offset_never_points_past_the_text_with_special_tokens(oai, engine, tokenizer, stream):
    """Special tokens the model writes are left out of the text, so they take no room in
    `text_offset`; an echoed prompt keeps the special tokens it was written with."""
    special = {tokenizer.id_to_token(i) for i in tokenizer.special_ids}
    bos = tokenizer.token_to_id("<|begin_of_text|>")
    engine.model.script = [*tokenizer.encode("Hello"), bos, bos, *tokenizer.encode(" world")]
    prompt = "Say<|begin_of_text|> it"
    try:  # the scripted model cannot force an echo's output (it scores the prompt): max 0
        for echo in (False, True):
            kwargs = dict(prompt=prompt, max_tokens=0 if echo else 10, logprobs=1, echo=echo)
            if stream:
                text, tokens, offsets = "", [], []
                for c in _create(oai, stream=True, **kwargs):
                    for ch in c.choices:
                        text += ch.text
                        if ch.logprobs is not None:
                            tokens += ch.logprobs.tokens
                            offsets += ch.logprobs.text_offset
                lp = type("LP", (), {"tokens": tokens, "text_offset": offsets})
            else:
                choice = _create(oai, **kwargs).choices[0]
                text, lp = choice.text, choice.logprobs
            assert text == (prompt if echo else "Hello world")
            assert lp.tokens.count("<|begin_of_text|>") == (1 if echo else 2)
            _offsets_point_into_the_text(text, lp, special)
    finally:
        engine.model.script = None


@pytest.mark.parametrize("stream", [False, True])
def test_stop(oai, script, stream):
    script("alpha beta gamma delta")
    kwargs = dict(prompt=PROMPT, max_tokens=30, stop=["gam", "zzz"])
    if stream:
        chunks = list(_create(oai, stream=True, **kwargs))
        text = "".join(ch.text for c in chunks for ch in c.choices)
        reason = [ch.finish_reason for c in chunks for ch in c.choices][-1]
    else:
        r = _create(oai, **kwargs)
        text, reason = r.choices[0].text, r.choices[0].finish_reason
    assert (text, reason) == ("alpha beta ", "stop")


BAD = [
    ({"prompt": PROMPT, "logprobs": 21}, "logprobs"),
    ({"prompt": ""}, "prompt"),
    ({"prompt": []}, "prompt"),
    ({"prompt": ["ok", ""]}, "prompt"),
    ({"prompt": [1, 2, 99999]}, "prompt"),
    ({"prompt": [[1, 2], [-1]]}, "prompt"),
    ({"prompt": [1, "a"]}, "prompt"),
    ({"prompt": PROMPT, "max_tokens": 0}, "max_tokens"),
    ({"prompt": PROMPT, "max_tokens": -1}, "max_tokens"),
    ({"prompt": PROMPT, "suffix": "x"}, "suffix"),
    ({"prompt": PROMPT, "n": 3, "best_of": 2}, "best_of"),
    ({"prompt": PROMPT, "n": 0}, "n"),
    ({"max_tokens": 2}, "prompt"),
    ({"prompt": "word " * 3000}, "prompt"),
]


@pytest.mark.parametrize("body, param", BAD)
def test_bad_requests(base_url, body, param):
    r = httpx.post(base_url + "/v1/completions", json=body, timeout=30)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["type"] == "invalid_request_error"
    assert err["param"].startswith(param) and param in err["message"], err


def test_sdk_sees_400(oai):
    with pytest.raises(openai.BadRequestError, match="logprobs") as e:
        _create(oai, prompt=PROMPT, logprobs=50)
    assert e.value.body["param"] == "logprobs"
    with pytest.raises(openai.BadRequestError, match="vocabulary"):
        _create(oai, prompt=[5, 10**6])


# --------------------------------------------------------------------------- lm-eval
MC_DOCS = [
    {"question": "import os\nimport", "choices": [" sys", " re", " json"], "answer": 0},
    {"question": "def main(", "choices": ["self", "):", "args):"], "answer": 2},
    {
        "question": "class Path:\n    def",
        "choices": [" __init__", " join", " exists(self)"],
        "answer": 0,
    },
    {"question": "return", "choices": [" None", " True", " self._x"], "answer": 1},
]


@pytest.fixture(scope="module")
def mc_task(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("mc-task")
    data = root / "mc.jsonl"
    data.write_text("".join(json.dumps(d) + "\n" for d in MC_DOCS))
    (root / "mc.yaml").write_text(
        f"task: astrai_serve_mc\ndataset_path: json\ndataset_kwargs:\n  data_files:\n"
        f"    test: {data}\ntest_split: test\noutput_type: multiple_choice\n"
        'doc_to_text: "{{question}}"\ndoc_to_choice: "{{choices}}"\ndoc_to_target: answer\n'
        "metric_list:\n  - metric: acc\n  - metric: acc_norm\n"
    )
    return root


@pytest.fixture(scope="module")
def live_server(model_dir) -> str:
    """`python -m astrai.serve` in a subprocess on a free port (paged KV, prefix cache)."""
    port = free_port()
    args = [f"model_path={model_dir}", f"port={port}", "engine=paged", "engine.kv_tokens=8192"]
    args += ["engine.max_batch_size=8", "device=cpu", "dtype=float32"]
    proc = subprocess.Popen(
        [sys.executable, "-m", "astrai.serve", *args],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(proc, url, 180)
        yield url
    finally:
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0, out


@pytest.mark.slow
def test_lm_eval_local_completions_matches_astrai_model(live_server, model_dir, mc_task):
    """lm-eval's `local-completions` against the live server scores each choice as lm-eval's
    `astrai` model (the engine in process) does: same log-likelihoods (1e-4), greedy flags
    and accuracy."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    import astrai.eval.harness  # noqa: F401  (registers the `astrai` model)

    def run(model: str, args: dict) -> dict:
        return lm_eval.simple_evaluate(
            model=model,
            model_args=args,
            tasks=["astrai_serve_mc"],
            task_manager=TaskManager(include_path=str(mc_task)),
            log_samples=True,
            bootstrap_iters=0,
        )

    served = run(
        "local-completions",
        {
            "base_url": f"{live_server}/v1/completions",
            "model": "astrai",
            "tokenizer_backend": "huggingface",
            "tokenizer": str(model_dir),
            "tokenized_requests": True,
            "add_bos_token": True,
            "batch_size": 4,
            "max_retries": 1,
        },
    )
    local = run("astrai", {"pretrained": str(model_dir), "dtype": "float32", "device": "cpu"})
    docs = [
        sorted(r["samples"]["astrai_serve_mc"], key=lambda s: s["doc_id"]) for r in (served, local)
    ]
    assert len(docs[0]) == len(docs[1]) == len(MC_DOCS)
    for a, b in zip(*docs):
        assert len(a["resps"]) == len(MC_DOCS[a["doc_id"]]["choices"])
        for (got,), (ref,) in zip(a["resps"], b["resps"]):
            assert got[0] == pytest.approx(ref[0], abs=1e-4)
            assert got[1] == ref[1]
            assert got[0] < 0
        assert (a["acc"], a["acc_norm"]) == (b["acc"], b["acc_norm"])
