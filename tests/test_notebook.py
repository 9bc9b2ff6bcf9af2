"""The generation notebook runs top to bottom against a tiny model built here."""

from pathlib import Path

import nbformat
import pytest
import torch
from nbclient import NotebookClient

from astrai.model import ModelConfig, Transformer
from astrai.tokenizer import AutoTokenizer

NOTEBOOK = Path(__file__).resolve().parents[1] / "notebooks" / "generate.ipynb"


@pytest.mark.slow
def test_generate_notebook_runs(tmp_path, monkeypatch):
    texts = ["The sea is calm tonight. 12 + 30 = 42.\n" * 30, "def f(x):\n    return x\n" * 30]
    tok = AutoTokenizer.train(texts, vocab_size=300)
    cfg = ModelConfig(
        vocab_size=len(tok),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        max_position_embeddings=512,
    )
    torch.manual_seed(0)
    Transformer(cfg).save_pretrained(tmp_path / "model", tokenizer=tok)
    monkeypatch.setenv("ASTRAI_MODEL", str(tmp_path / "model"))
    nb = nbformat.read(NOTEBOOK, as_version=4)
    NotebookClient(
        nb,
        timeout=300,
        kernel_name="python3",
        resources={"metadata": {"path": str(NOTEBOOK.parent)}},
    ).execute()
    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])]
    assert not [o for o in outputs if o.output_type == "error"]
    assert any("image/png" in o.get("data", {}) for o in outputs), "the log-prob plot is missing"
    text = "".join(o.get("text", "") for o in outputs if o.output_type == "stream")
    assert "parameters" in text and "greedy" in text
