"""The HF export check the model-family tests share."""

from __future__ import annotations

from pathlib import Path

import torch
import transformers
from safetensors import safe_open

from astrai.model import AutoModel, save_pretrained


def assert_export_round_trip(hf: torch.nn.Module, tmp_path: Path, x: torch.Tensor) -> None:
    """`hf` saved by transformers, imported by us, exported in HF format: the export has the
    tensor names transformers itself writes, loads as the same class, and every model gives
    the same logits (fp32, 1e-5)."""
    hf.save_pretrained(tmp_path / "hf")
    ours = AutoModel.from_pretrained(tmp_path / "hf")
    save_pretrained(ours, tmp_path / "export", hf_format=True)
    with safe_open(str(tmp_path / "export" / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
    with safe_open(str(tmp_path / "hf" / "model.safetensors"), "pt") as f:
        assert keys == set(f.keys())  # the names transformers itself writes
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "export").eval()
    assert type(back).__name__ == type(hf).__name__
    with torch.no_grad():
        torch.testing.assert_close(back(x).logits, ours(x), atol=1e-5, rtol=0)
        torch.testing.assert_close(back(x).logits, hf(x).logits, atol=1e-5, rtol=0)
