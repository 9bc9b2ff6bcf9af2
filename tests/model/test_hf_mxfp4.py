"""MXFP4 checkpoints (`astrai.model.hf_mxfp4`): a tiny GPT-OSS whose expert weights are
random MXFP4 blocks and scales, written as the official checkpoints store them
(`*_blocks` / `*_scales`, `quant_method: "mxfp4"`), loads with the logits of transformers'
model holding the same weights dequantised by transformers' own
`convert_moe_packed_tensors`; blocks without scales are refused, naming the tensor."""

from __future__ import annotations

import json
import re

import pytest
import torch
from hf_helpers import build_gpt_oss
from safetensors.torch import load_file, save_file
from transformers.integrations.mxfp4 import convert_moe_packed_tensors

from astrai.model import AutoModel
from astrai.model.hf_mxfp4 import Mxfp4CheckpointError


def write_mxfp4(tmp_path):
    """The tiny GPT-OSS with MXFP4 experts: its directory and the transformers model."""
    hf = build_gpt_oss()
    e, h, i = 4, 64, 32
    gen = torch.Generator().manual_seed(7)
    quantised: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        for n, layer in enumerate(hf.model.layers):
            for proj, rows, cols in (("gate_up_proj", 2 * i, h), ("down_proj", h, i)):
                blocks = torch.randint(0, 256, (e, rows, cols // 32, 16), generator=gen)
                scales = torch.randint(118, 123, (e, rows, cols // 32), generator=gen)
                blocks, scales = blocks.to(torch.uint8), scales.to(torch.uint8)
                weight = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)
                getattr(layer.mlp.experts, proj).copy_(weight)
                name = f"model.layers.{n}.mlp.experts.{proj}"
                quantised[name + "_blocks"], quantised[name + "_scales"] = blocks, scales
    hf.save_pretrained(tmp_path)
    file = tmp_path / "model.safetensors"
    state = load_file(str(file))
    for key in quantised:
        state.pop(key.removesuffix("_blocks").removesuffix("_scales"), None)
    save_file({**state, **quantised}, str(file), metadata={"format": "pt"})
    config = json.loads((tmp_path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4"}
    (tmp_path / "config.json").write_text(json.dumps(config))
    return hf


def test_mxfp4_checkpoint_loads_with_transformers_logits(tmp_path):
    hf = write_mxfp4(tmp_path)
    ours = AutoModel.from_pretrained(tmp_path)
    assert ours.layers[0].mlp.experts.gate_up_proj.dtype == torch.float32
    x = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(ours(x), hf(x).logits, atol=1e-5, rtol=0)


def test_mxfp4_blocks_without_scales_are_refused_naming_them(tmp_path):
    write_mxfp4(tmp_path)
    file = tmp_path / "model.safetensors"
    state = load_file(str(file))
    del state["model.layers.2.mlp.experts.down_proj_scales"]
    save_file(state, str(file), metadata={"format": "pt"})
    with pytest.raises(
        Mxfp4CheckpointError, match=re.escape("layers.2.mlp.experts.down_proj_blocks")
    ):
        AutoModel.from_pretrained(tmp_path)
