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


# ---------------------------------------------------------------- a separate embedding export
@pytest.fixture(scope="module")
def export_dir(tmp_path_factory, build_model_dir):
    """An embedding export in HF format (what transformers reads, and astrai's AutoModel),
    with its own tokenizer and a short context (64 tokens)."""
    from astrai.tokenizer import AutoTokenizer

    texts = ["def add(a, b):\n    return a + b\nimport os\nclass Base:\n    pass\n" * 20]
    root = tmp_path_factory.mktemp("exports")
    ours = build_model_dir(root / "ours", texts, vocab_size=280, seed=1, max_position_embeddings=64)
    hf = root / "embedder"
    own = AutoTokenizer.from_pretrained(ours)
    save_pretrained(AutoModel.from_pretrained(ours), hf, tokenizer=own, hf_format=True)
    return hf


@pytest.fixture(scope="module")
def export_oai(engine, export_dir):
    from astrai.inference.embedding import Embedder

    embedding = Embedder.from_pretrained(export_dir, "mean")
    app = create_app(engine, ServeSettings(pooling_type="mean"), embedding=embedding)
    with (
        ServerThread(app) as srv,
        openai.OpenAI(base_url=f"{srv.url}/v1", api_key="x", max_retries=0) as client,
    ):
        yield client, srv.url


def test_separate_export_answers_under_its_name(export_oai, export_dir, reference, tokenizer):
    """The export embeds with its own tokenizer, equal to transformers' forward of it; the
    served model still embeds under its own name; /v1/models lists both."""
    from astrai.tokenizer import AutoTokenizer

    client, _ = export_oai
    export_ref = transformers.AutoModel.from_pretrained(export_dir, dtype=torch.float32).eval()
    own = AutoTokenizer.from_pretrained(export_dir)
    ids = [own.encode(t) for t in TEXTS]
    assert ids != [tokenizer.encode(t) for t in TEXTS]
    r = client.embeddings.create(model="embedder", input=TEXTS, encoding_format="float")
    b64 = client.embeddings.create(model="embedder", input=TEXTS, encoding_format="base64")
    decoded = client.embeddings.create(model="embedder", input=TEXTS)  # the SDK's base64
    assert r.model == "embedder"
    assert r.usage.prompt_tokens == sum(len(i) for i in ids)
    for got, got64, sdk, prompt in zip(r.data, b64.data, decoded.data, ids, strict=True):
        want = _expected(export_ref, prompt, "mean")
        raw = np.frombuffer(base64.b64decode(got64.embedding), dtype="<f4")
        for vector in (got.embedding, raw.tolist(), sdk.embedding):
            torch.testing.assert_close(torch.tensor(vector), want, atol=1e-5, rtol=0)
    served = client.embeddings.create(model="astrai", input=TEXTS[1], encoding_format="float")
    assert served.model == "astrai"
    want = _expected(reference, tokenizer.encode(TEXTS[1]), "mean")
    torch.testing.assert_close(torch.tensor(served.data[0].embedding), want, atol=1e-5, rtol=0)
    assert [m.id for m in client.models.list()] == ["astrai", "embedder"]


def test_separate_export_without_model_and_bad_names(export_oai):
    client, url = export_oai
    import httpx

    body = {"input": "import os", "encoding_format": "float"}
    no_model = httpx.post(f"{url}/v1/embeddings", json=body, timeout=60).json()
    named = client.embeddings.create(model="embedder", input="import os", encoding_format="float")
    assert no_model["model"] == "embedder"
    assert no_model["data"][0]["embedding"] == named.data[0].embedding
    with pytest.raises(openai.NotFoundError) as info:
        client.embeddings.create(model="gpt-x", input="import os")
    assert info.value.body["param"] == "model" and "embedder" in info.value.body["message"]
    # the export's own context (64 tokens) and vocabulary (280) bound its inputs
    with pytest.raises(openai.BadRequestError) as info:
        client.embeddings.create(model="embedder", input=[[1] * 65])
    assert info.value.body["param"] == "input" and "(64)" in info.value.body["message"]
    with pytest.raises(openai.BadRequestError) as info:
        client.embeddings.create(model="embedder", input=[[280]])
    assert info.value.body["param"] == "input" and "0..279" in info.value.body["message"]


def test_with_adapters_names_are_checked_as_on_the_generation_routes(
    model_dir, tokenizer, tmp_path
):
    """Where the engine serves LoRA adapters an unknown name is vLLM's 404; an adapter's name
    is a 400 (embeddings come from the base model only); the base's name embeds."""
    from lora_helpers import make_adapter

    from astrai.inference import InferenceEngine

    engine = InferenceEngine(
        AutoModel.from_pretrained(model_dir).eval(),
        tokenizer,
        max_batch_size=2,
        max_seq_len=256,
        lora={"max_loras": 2, "max_lora_rank": 8},
    )
    try:
        engine.load_adapter("a", make_adapter(model_dir, tmp_path / "a", r=4, seed=1))
        app = create_app(engine, ServeSettings(model_name="base"))
        with (
            ServerThread(app) as srv,
            openai.OpenAI(base_url=f"{srv.url}/v1", api_key="x", max_retries=0) as client,
        ):
            assert client.embeddings.create(model="base", input="import os").model == "base"
            with pytest.raises(openai.NotFoundError) as missing:
                client.embeddings.create(model="nope", input="import os")
            with pytest.raises(openai.BadRequestError) as adapter:
                client.embeddings.create(model="a", input="import os")
    finally:
        engine.shutdown()
    assert missing.value.body["param"] == adapter.value.body["param"] == "model"
    assert "LoRA adapter" in adapter.value.body["message"]
