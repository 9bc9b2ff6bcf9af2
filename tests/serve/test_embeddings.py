"""`POST /v1/embeddings` through the official `openai` SDK, against transformers' own
forward of the served model's export (`last_hidden_state`: after the final norm), pooled
and normalised in plain torch."""

from __future__ import annotations

import base64

import numpy as np
import openai
import pytest
import torch
import transformers

from astrai.model import AutoModel, save_pretrained
from astrai.serve import ServerThread, ServeSettings, create_app

TEXTS = ["def add(a, b):\n    return a + b", "import os", "class Base:\n    pass"]


@pytest.fixture(scope="module")
def reference(model_dir, tmp_path_factory):
    """The served weights exported in HF format, loaded by transformers (its base model)."""
    export = tmp_path_factory.mktemp("hf-export")
    save_pretrained(AutoModel.from_pretrained(model_dir), export, hf_format=True)
    return transformers.AutoModel.from_pretrained(export, dtype=torch.float32).eval()


def _expected(reference, ids: list[int], pooling_type: str) -> torch.Tensor:
    with torch.no_grad():
        hidden = reference(torch.tensor([ids])).last_hidden_state[0].float()
    pooled = {"mean": hidden.mean(0), "last": hidden[-1], "cls": hidden[0]}[pooling_type]
    return pooled / pooled.norm()


@pytest.fixture(scope="module", params=["mean", "last", "cls"])
def pooled_oai(request, engine):
    app = create_app(engine, ServeSettings(pooling_type=request.param))
    with (
        ServerThread(app) as srv,
        openai.OpenAI(base_url=f"{srv.url}/v1", api_key="x", max_retries=0) as client,
    ):
        yield request.param, client


def test_float_and_base64_equal_plain_pooling(pooled_oai, reference, tokenizer):
    pooling_type, client = pooled_oai
    r = client.embeddings.create(model="astrai", input=TEXTS, encoding_format="float")
    # Without encoding_format the SDK asks for base64 and decodes it itself.
    decoded = client.embeddings.create(model="astrai", input=TEXTS)
    b64 = client.embeddings.create(model="astrai", input=TEXTS, encoding_format="base64")
    ids = [tokenizer.encode(t) for t in TEXTS]
    assert [d.index for d in r.data] == [0, 1, 2] and r.object == "list"
    assert r.usage.prompt_tokens == r.usage.total_tokens == sum(len(i) for i in ids)
    for got, sdk, got64, prompt in zip(r.data, decoded.data, b64.data, ids, strict=True):
        want = _expected(reference, prompt, pooling_type)
        raw = np.frombuffer(base64.b64decode(got64.embedding), dtype="<f4")
        for vector in (got.embedding, sdk.embedding, raw.tolist()):
            torch.testing.assert_close(torch.tensor(vector), want, atol=1e-5, rtol=0)
    # token ids embed as the text they encode
    r_ids = client.embeddings.create(model="astrai", input=ids[0], encoding_format="float")
    assert r_ids.data[0].embedding == r.data[0].embedding


def _bad(client, **kw) -> openai.BadRequestError:
    with pytest.raises(openai.BadRequestError) as info:
        client.embeddings.create(model="astrai", **kw)
    return info.value


def test_errors_name_the_field(oai, engine):
    assert _bad(oai, input="hi", dimensions=8).body["param"] == "dimensions"
    assert _bad(oai, input=[]).body["param"] == "input"
    assert _bad(oai, input=[[engine.vocab_size]]).body["param"] == "input"
    too_long = _bad(oai, input=[[1] * (engine.max_seq_len + 1)])
    assert too_long.body["param"] == "input" and "context length" in too_long.body["message"]
