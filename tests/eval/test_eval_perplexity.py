"""PerplexitySuite against one plain dense forward per window, and its windows against
lm-evaluation-harness's own rolling windows."""

import math
import re

import numpy as np
import pytest
from suite_helpers import dense_logprobs, engine_for, write_jsonl

from astrai.data.storage import DataError
from astrai.eval import PerplexitySuite
from astrai.eval.perplexity import rolling_windows

TEXTS = [
    "def add(a, b):\n    return a + b\n",
    "import os\nprint(os.getcwd())  # the working directory\n",
    "Question: What is 2 + 3?\nAnswer: 5 — naïve café\n",  # multi-byte characters
]


@pytest.mark.parametrize(
    "n,max_len,context_len",
    [(1, 4, 1), (10, 4, 1), (37, 8, 1), (37, 8, 3), (64, 16, 16), (5, 16, 2)],
)
def test_rolling_windows_match_lm_eval(n, max_len, context_len):
    utils = pytest.importorskip("lm_eval.utils")
    tokens = list(range(100, 100 + n))
    expected = [
        utils.make_disjoint_window(w)
        for w in utils.get_rolling_token_windows(tokens, 7, max_len, context_len)
    ]
    got = rolling_windows(tokens, 7, max_len, context_len)
    assert [(list(c), list(t)) for c, t in expected] == got
    assert [t for _, w in got for t in w] == tokens  # disjoint, in order, complete
    assert all(len(c) + len(w) <= max_len + 1 for c, w in got)


def reference_nats(model, prefix, targets, max_len, context_len):
    """Sliding-window nats: each target window read off the last logits of the `max_len`
    tokens that end just before its last target (first window: from the prefix)."""
    full = [prefix, *targets]  # targets[t] is full[t + 1]
    nats, done, step = 0.0, 0, max_len - context_len + 1
    while done < len(targets):
        end = min(len(targets), max_len if done == 0 else done + step)
        lo = max(0, end - max_len)
        window = full[lo : end + 1]
        lp = dense_logprobs(model, window)  # scores window[1:] = full[lo + 1 : end + 1]
        nats -= float(lp[done - lo :].sum())
        done = end
    return nats


def test_short_documents_match_dense_forward(tok, model, tmp_path):
    path = write_jsonl(tmp_path / "docs.jsonl", [{"text": t} for t in TEXTS])
    suite = PerplexitySuite(path=str(path))
    with engine_for(model, tok) as engine:
        result = suite.run(engine)
    eos = tok.eos_token_id
    doc_nats, doc_tokens, doc_bytes, words = [], [], [], []
    for text in TEXTS:
        ids = tok.encode(text)
        doc_nats.append(-float(dense_logprobs(model, [eos, *ids]).sum()))
        doc_tokens.append(len(ids))
        doc_bytes.append(len(text.encode("utf-8")))
        words.append(len(re.split(r"\s+", text)))
    nats, tokens = sum(doc_nats), sum(doc_tokens)
    m = result.metrics
    assert m["nll"] == pytest.approx(nats / tokens, rel=1e-5)
    assert m["ppl"] == pytest.approx(math.exp(nats / tokens), rel=1e-5)
    assert m["bpb"] == pytest.approx(nats / (math.log(2) * sum(doc_bytes)), rel=1e-5)
    assert m["word_ppl"] == pytest.approx(math.exp(nats / sum(words)), rel=1e-5)
    doc_ppl = [math.exp(n / t) for n, t in zip(doc_nats, doc_tokens)]
    for q in (10, 50, 90):
        assert m[f"doc_ppl_p{q}"] == pytest.approx(np.percentile(doc_ppl, q), rel=1e-5)
    assert m["tokens"] == tokens
    assert [row["bytes"] for row in result.samples] == doc_bytes
    assert [row["where"] for row in result.samples] == [f"{path}:{i}" for i in (1, 2, 3)]


@pytest.mark.parametrize("context_len", [1, 8])
def test_long_document_rolls_windows_like_dense_forward(tok, model, tmp_path, context_len):
    text = "".join(TEXTS) * 4
    targets = tok.encode(text)
    max_seq_len = 32  # the engine's context: requests of at most 32 tokens
    assert len(targets) > 3 * max_seq_len
    (tmp_path / "doc.txt").write_text(text, encoding="utf-8")
    suite = PerplexitySuite(path=str(tmp_path / "doc.txt"), context_len=context_len)
    with engine_for(model, tok, max_seq_len=max_seq_len) as engine:
        result = suite.run(engine)
    expected = reference_nats(model, tok.eos_token_id, targets, max_seq_len - 1, context_len)
    assert result.metrics["nll"] == pytest.approx(expected / len(targets), rel=1e-5)
    assert result.samples[0]["windows"] > 3
    # the windows matter: the whole document in one forward gives another value
    whole = -float(dense_logprobs(model, [tok.eos_token_id, *targets]).sum())
    assert abs(whole - expected) / len(targets) > 1e-3


def test_token_documents_and_their_own_prefix(tok, model, tmp_path):
    ids = tok.encode(TEXTS[0])
    bos = tok.bos_token_id
    rows = [{"input_ids": [bos, *ids]}, {"input_ids": ids}]
    suite = PerplexitySuite(path=str(write_jsonl(tmp_path / "ids.jsonl", rows)), key="input_ids")
    with engine_for(model, tok) as engine:
        result = suite.run(engine)
    own = -float(dense_logprobs(model, [bos, *ids]).sum())  # the document's bos is the prefix
    after_eos = -float(dense_logprobs(model, [tok.eos_token_id, *ids]).sum())
    assert result.samples[0]["nll"] == pytest.approx(own / len(ids), rel=1e-5)
    assert result.samples[1]["nll"] == pytest.approx(after_eos / len(ids), rel=1e-5)
    assert result.samples[0]["bytes"] == len(TEXTS[0].encode())


def test_bad_documents_name_file_and_line(tmp_path):
    bad_json = write_jsonl(tmp_path / "a.jsonl", [{"text": "ok"}, "{oops"])
    with pytest.raises(DataError, match=re.escape(f"{bad_json}:2")):
        PerplexitySuite(path=str(bad_json))
    empty = write_jsonl(tmp_path / "b.jsonl", [{"text": "ok"}, {"text": ""}])
    with pytest.raises(DataError, match=re.escape(f"{empty}:2") + ".*empty"):
        PerplexitySuite(path=str(empty))
    missing = write_jsonl(tmp_path / "c.jsonl", [{"body": "x"}])
    with pytest.raises(DataError, match=re.escape(f"{missing}:1") + ".*'text'"):
        PerplexitySuite(path=str(missing))


def test_default_corpus_is_held_out_stdlib(tok):
    suite = PerplexitySuite(limit=2)
    assert len(suite.documents) == 2 and suite.documents[0].where.startswith("stdlib:")
    assert suite.required_seq_len(tok) > 2
