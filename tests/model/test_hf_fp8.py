"""Block-fp8 (DeepSeek-V3 / R1 official layout) checkpoints: dequantised on load to the logits
of transformers' own `FineGrainedFP8Config(dequantize=True)`; a missing or misshapen
`_scale_inv` is a clear error naming the tensor."""

import json
import math

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from astrai.model import AutoModel
from astrai.model.hf_fp8 import Fp8CheckpointError, dequantize_block

FP8_MAX = 448.0  # largest finite float8_e4m3fn
QUANTIZED = ("_proj.weight", "kv_a_proj_with_mqa.weight")  # not the router, norms or embeddings


def quantize(weight: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-block amax / 448 scales, as DeepSeek's own fp8 cast does."""
    rows, cols = weight.shape
    grid = (math.ceil(rows / block[0]), math.ceil(cols / block[1]))
    scale = torch.empty(grid)
    q = torch.empty(rows, cols, dtype=torch.float8_e4m3fn)
    for i in range(grid[0]):
        for j in range(grid[1]):
            rs, cs = (
                slice(i * block[0], (i + 1) * block[0]),
                slice(j * block[1], (j + 1) * block[1]),
            )
            s = weight[rs, cs].abs().amax().clamp(min=1e-12) / FP8_MAX
            scale[i, j] = s
            q[rs, cs] = (weight[rs, cs] / s).to(torch.float8_e4m3fn)
    return q, scale


def dequantize_loop(q: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    out = q.float()
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            out[i * block[0] : (i + 1) * block[0], j * block[1] : (j + 1) * block[1]] *= scale[i, j]
    return out


def write_fp8_deepseek(path, block: tuple[int, int]) -> None:
    config = transformers.DeepseekV3Config(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        kv_lora_rank=32,
        q_lora_rank=24,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=16,
        moe_intermediate_size=32,
        n_routed_experts=4,
        num_experts_per_tok=2,
        n_shared_experts=1,
        first_k_dense_replace=1,
        n_group=1,
        topk_group=1,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = transformers.DeepseekV3ForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.add_(torch.randn_like(p) * (1.0 if name.endswith("mlp.gate.weight") else 0.05))
    model.save_pretrained(path)
    state = load_file(path / "model.safetensors")
    out = {}
    for key, tensor in state.items():
        if key.endswith(QUANTIZED) and not key.endswith("mlp.gate.weight"):
            out[key], out[key + "_scale_inv"] = quantize(tensor, block)
        else:
            out[key] = tensor
    save_file(out, path / "model.safetensors", metadata={"format": "pt"})
    data = json.loads((path / "config.json").read_text())
    data["quantization_config"] = dict(
        quant_method="fp8", fmt="e4m3", activation_scheme="dynamic", weight_block_size=list(block)
    )
    (path / "config.json").write_text(json.dumps(data))


def test_fp8_directory_loads_with_transformers_dequantized_logits(tmp_path):
    write_fp8_deepseek(tmp_path, (8, 8))  # every dim a multiple: transformers' own grid fits
    ours = AutoModel.from_pretrained(tmp_path, dtype=torch.float32)
    ref = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path,
        dtype=torch.float32,
        quantization_config=transformers.FineGrainedFP8Config(dequantize=True),
    ).eval()
    x = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(ours(x), ref(x).logits, atol=1e-5, rtol=0)


def test_edge_blocks_are_cropped():
    torch.manual_seed(0)
    weight = torch.randn(40, 24)  # 3 x 2 blocks of 16, the last row / column blocks partial
    q, scale = quantize(weight, (16, 16))
    got = dequantize_block(q, scale, (16, 16), torch.float32)
    torch.testing.assert_close(got, dequantize_loop(q, scale, (16, 16)), atol=0, rtol=0)
    torch.testing.assert_close(got, weight, atol=0.0, rtol=0.07)  # e4m3: 3 mantissa bits


def _edit(path, edit) -> None:
    state = load_file(path / "model.safetensors")
    edit(state)
    save_file(state, path / "model.safetensors", metadata={"format": "pt"})


KEY = "model.layers.1.self_attn.o_proj.weight"


def test_missing_scale_is_an_error_naming_the_tensor(tmp_path):
    write_fp8_deepseek(tmp_path, (16, 16))
    _edit(tmp_path, lambda s: s.pop(KEY + "_scale_inv"))
    with pytest.raises(Fp8CheckpointError, match=f"{KEY} has no {KEY}_scale_inv"):
        AutoModel.from_pretrained(tmp_path)


def test_misshapen_scale_is_an_error_naming_the_tensor(tmp_path):
    write_fp8_deepseek(tmp_path, (16, 16))
    _edit(tmp_path, lambda s: s.update({KEY + "_scale_inv": torch.ones(4, 5)}))
    with pytest.raises(Fp8CheckpointError, match=rf"{KEY}_scale_inv has shape \(4, 5\).*\(4, 4\)"):
        AutoModel.from_pretrained(tmp_path)


def test_fp8_weights_without_quantization_config_are_refused(tmp_path):
    write_fp8_deepseek(tmp_path, (16, 16))
    data = json.loads((tmp_path / "config.json").read_text())
    del data["quantization_config"]
    (tmp_path / "config.json").write_text(json.dumps(data))
    with pytest.raises(Fp8CheckpointError, match="no quantization_config"):
        AutoModel.from_pretrained(tmp_path)
