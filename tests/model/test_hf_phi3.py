"""Phi-3 / Phi-4 (`astrai.model.hf_phi3`): fused qkv / gate_up projections and partial rotary
(Phi-4-mini). Logit parity both ways is in test_hf_interop.py's CASES; here the export's
tensor names, the engine's greedy tokens against transformers' `generate`, a LoRA training,
and the refusals (longrope, a real sliding window)."""

import json

import pytest
import torch
import transformers
from hf_helpers import (
    SIZES,
    assert_engine_greedy_equals_hf,
    assert_export_round_trip,
    assert_lora_trains,
)

from astrai.model import AutoModel, ConfigError, ModelConfig, Transformer, save_pretrained
from astrai.model.layers import PartialRotary

PARTIAL = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.75}
CASES = {"phi3": {}, "phi4-mini": dict(rope_parameters=PARTIAL, tie_word_embeddings=True)}


def build_hf(case: str, vocab: int = 320) -> transformers.Phi3ForCausalLM:
    config = transformers.Phi3Config(
        vocab_size=vocab, pad_token_id=1, bos_token_id=0, eos_token_id=2, **SIZES, **CASES[case]
    )
    torch.manual_seed(0)
    model = transformers.Phi3ForCausalLM(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return model


@pytest.mark.parametrize("case", sorted(CASES))
def test_phi3_export_fuses_projections_as_transformers_names_them(case, tmp_path):
    x = torch.randint(0, 320, (2, 20), generator=torch.Generator().manual_seed(1))
    assert_export_round_trip(build_hf(case), tmp_path, x)


def test_partial_rotary_is_read_and_rotates_three_quarters(tmp_path):
    build_hf("phi4-mini").save_pretrained(tmp_path)
    ours = AutoModel.from_pretrained(tmp_path)
    assert ours.config.partial_rotary_factor == 0.75 and ours.config.rotary_dim() == 12
    rotate = ours.layers[0].self_attn.rotate_qk
    assert isinstance(rotate, PartialRotary)
    # The pass-through dims are untouched, whatever the angle.
    q, k = torch.randn(5, 4, 16), torch.randn(5, 2, 16)
    cos, sin = torch.randn(5, 6), torch.randn(5, 6)
    q2, k2 = rotate(q, k, cos, sin)
    assert torch.equal(q2[..., 12:], q[..., 12:]) and torch.equal(k2[..., 12:], k[..., 12:])
    assert not torch.allclose(q2[..., :12], q[..., :12])


@pytest.mark.parametrize("case", sorted(CASES))
def test_engine_greedy_equals_transformers_generate(case, tmp_path, stdlib_tokenizer):
    hf = build_hf(case, len(stdlib_tokenizer))
    assert_engine_greedy_equals_hf(hf, tmp_path, stdlib_tokenizer)


@pytest.mark.parametrize("case", sorted(CASES))
def test_lora_trains_on_phi3(case, tmp_path):
    assert_lora_trains(build_hf(case), tmp_path)


def _rewrite_config(path, **changes) -> None:
    data = json.loads((path / "config.json").read_text())
    data.update(changes)
    (path / "config.json").write_text(json.dumps(data))


def test_longrope_is_refused_naming_the_field_and_a_window_loads(tmp_path):
    build_hf("phi3").save_pretrained(tmp_path)
    longrope = {"rope_type": "longrope", "short_factor": [1.0] * 8, "long_factor": [2.0] * 8}
    _rewrite_config(tmp_path, rope_scaling=longrope, rope_parameters=None)
    with pytest.raises(ConfigError, match="rope_scaling of type 'longrope'"):
        AutoModel.from_pretrained(tmp_path)
    _rewrite_config(tmp_path, rope_scaling=None, sliding_window=32)  # one on every layer
    assert AutoModel.from_pretrained(tmp_path).config.sliding_window == 32
    _rewrite_config(tmp_path, sliding_window=128)  # as long as the context: no window at all
    windowless = AutoModel.from_pretrained(tmp_path).config
    assert windowless.hf_model_type == "phi3" and windowless.sliding_window is None


def test_partial_rotary_without_a_phi3_equivalent_is_refused(tmp_path):
    cfg = ModelConfig(vocab_size=64, **SIZES, partial_rotary_factor=0.5, qk_norm=True)
    with pytest.raises(ConfigError, match="partial_rotary_factor"):
        save_pretrained(Transformer(cfg), tmp_path, hf_format=True)
    with pytest.raises(ConfigError, match="partial_rotary_factor"):
        ModelConfig(vocab_size=64, **SIZES, partial_rotary_factor=0.1)  # 16 * 0.1 -> 1 (odd)
