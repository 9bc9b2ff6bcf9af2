"""The generation notebook runs top to bottom against a tiny model built here."""

from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

NOTEBOOK = Path(__file__).resolve().parents[1] / "notebooks" / "generate.ipynb"


@pytest.mark.slow
def test_generate_notebook_runs(tmp_path, monkeypatch, build_model_dir):
    texts = ["The sea is calm tonight. 12 + 30 = 42.\n" * 30, "def f(x):\n    return x\n" * 30]
    build_model_dir(tmp_path / "model", texts, max_position_embeddings=512)
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
