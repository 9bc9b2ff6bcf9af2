"""OLMo 2 (`astrai.model.hf_olmo2`): post-norm blocks and whole-projection q/k norm. Logit
parity both ways is in test_hf_interop.py's CASES; here the export's tensor names, the
engine's greedy tokens against transformers' `generate`, a LoRA training, and refusals."""

import pytest
import torch
import transformers
from hf_helpers import (
    SIZES,
    assert_engine_greedy_equals_hf,
    assert_export_round_trip,
    assert_lora_trains,
)

from astrai.model import ConfigError, ModelConfig, Transformer, save_pretrained
from astrai.model.layers import ProjectionRMSNorm
from astrai.model.transformer import PostNormBlock


def build_hf(vocab: int = 320, **extra) -> transformers.Olmo2ForCausalLM:
    config = transformers.Olmo2Config(
        vocab_size=vocab, pad_token_id=1, eos_token_id=2, **{**SIZES, **extra}
    )
    torch.manual_seed(0)
    model = transformers.Olmo2ForCausalLM(config).eval()
    with torch.no_grad():  # norms start at 1: perturb them so each one matters
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return model


def test_olmo2_export_writes_transformers_names(tmp_path):
    hf = build_hf(attention_bias=True)
    x = torch.randint(0, 320, (2, 20), generator=torch.Generator().manual_seed(1))
    assert_export_round_trip(hf, tmp_path, x)


def test_olmo2_imports_as_post_norm_blocks_with_projection_qk_norm(tmp_path):
    hf = build_hf()
    hf.save_pretrained(tmp_path)
    from astrai.model import AutoModel

    ours = AutoModel.from_pretrained(tmp_path)
    assert ours.config.norm_position == "post" and ours.config.qk_norm_scope == "projection"
    assert all(type(b) is PostNormBlock for b in ours.layers)
    assert type(ours.layers[0].self_attn.q_norm) is ProjectionRMSNorm
    assert ours.num_parameters() == ours.config.num_parameters()


def test_engine_greedy_equals_transformers_generate(tmp_path, stdlib_tokenizer):
    assert_engine_greedy_equals_hf(build_hf(len(stdlib_tokenizer)), tmp_path, stdlib_tokenizer)


def test_lora_trains_on_olmo2(tmp_path):
    assert_lora_trains(build_hf(), tmp_path)


def test_variants_without_an_hf_equivalent_are_refused(tmp_path):
    cfg = ModelConfig(vocab_size=64, **SIZES, norm_position="post")  # no projection qk norm
    with pytest.raises(ConfigError, match="OLMo 2"):
        save_pretrained(Transformer(cfg), tmp_path, hf_format=True)
    with pytest.raises(ConfigError, match="norm_position"):
        ModelConfig(vocab_size=64, **SIZES, norm_position="middle")
    with pytest.raises(ConfigError, match="qk_norm_scope"):
        ModelConfig(vocab_size=64, **SIZES, qk_norm_scope="heads")
