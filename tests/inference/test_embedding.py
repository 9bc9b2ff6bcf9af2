"""`astrai.inference.embedding`: packed, batched embeddings equal one plain dense forward per
prompt pooled in plain torch, for every token budget; the served model's forwards run with
the engine's loop paused; a separate export embeds with its own tokenizer."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from astrai.inference import InferenceEngine
from astrai.inference.embedding import Embedder
from astrai.model import save_pretrained

LENGTHS = [5, 17, 1, 40, 9, 33, 2, 26]


def _prompts(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in LENGTHS]


def _reference(model, ids: list[int], pooling_type: str) -> torch.Tensor:
    """One prompt alone through the dense forward, pooled and normalised in plain torch."""
    with torch.no_grad():
        hidden = model(torch.tensor([ids]), return_hidden=True)[0].float()
    pooled = {"mean": hidden.mean(0), "last": hidden[-1], "cls": hidden[0]}[pooling_type]
    return F.normalize(pooled, dim=-1)


@pytest.fixture(scope="module")
def engine(model, tokenizer):
    eng = InferenceEngine(model, tokenizer, max_batch_size=4, max_seq_len=256)
    yield eng
    eng.shutdown()


@pytest.mark.parametrize("pooling_type", ["mean", "last", "cls"])
@pytest.mark.parametrize("budget", [1, 40, 64, 10_000])  # one per forward .. all in one
def test_batches_equal_one_forward_per_prompt(engine, model, pooling_type, budget):
    prompts = _prompts(model.config.vocab_size)
    embedder = Embedder.of_engine(engine, pooling_type, "m", max_batch_tokens=budget)
    got = embedder.embed(prompts)
    assert len(got) == len(prompts)
    for vector, ids in zip(got, prompts, strict=True):
        assert vector.dtype == torch.float32 and vector.device.type == "cpu"
        torch.testing.assert_close(vector, _reference(model, ids, pooling_type), atol=1e-5, rtol=0)


def test_served_model_forwards_run_with_the_loop_paused(engine, model):
    """Every embedding forward sees the engine's loop thread stopped; it runs again after."""
    assert engine.running
    seen: list[bool] = []
    hook = model.register_forward_pre_hook(lambda *_: seen.append(engine.running))
    try:
        Embedder.of_engine(engine, "mean", "m", max_batch_tokens=40).embed(
            _prompts(model.config.vocab_size)
        )
    finally:
        hook.remove()
    assert seen and not any(seen)
    assert engine.running


def test_separate_export_has_its_own_tokenizer(model, tokenizer, tmp_path, build_model_dir):
    other = build_model_dir(tmp_path / "emb", ["aaa bbb ccc " * 30], vocab_size=280)
    embedder = Embedder.from_pretrained(other, "last")
    assert embedder.name == "emb" and embedder.vocab_size == len(embedder.tokenizer)
    assert embedder.encode("aaa bbb") != tokenizer.encode("aaa bbb")
    ids = embedder.encode("aaa bbb ccc")
    torch.testing.assert_close(
        embedder.embed([ids])[0], _reference(embedder.model, ids, "last"), atol=1e-5, rtol=0
    )
    # a directory without a tokenizer embeds with the one it is given (the served model's)
    bare = tmp_path / "bare"
    save_pretrained(model, bare)
    borrowed = Embedder.from_pretrained(bare, "mean", tokenizer=tokenizer, name="e")
    assert borrowed.name == "e" and borrowed.encode("import os") == tokenizer.encode("import os")
    with pytest.raises(ValueError, match=r"embedding_model=.*tokenizer"):
        Embedder.from_pretrained(bare, "mean")


def test_bad_settings_name_the_parameter(engine):
    with pytest.raises(ValueError, match="pooling_type"):
        Embedder.of_engine(engine, "max", "m")
    with pytest.raises(ValueError, match="max_batch_tokens"):
        Embedder.of_engine(engine, "mean", "m", max_batch_tokens=-3)
