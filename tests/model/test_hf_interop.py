"""Logit parity with `transformers` for every supported HF architecture, both directions."""

import json

import pytest
import torch
import transformers

from astrai.model import AutoModel, ModelConfig, Transformer, save_pretrained

VOCAB = 320
BASE = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
    rms_norm_eps=1e-6,
)
LLAMA3 = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 16,
}

CASES = {
    "llama-llama3-tied": (
        transformers.LlamaConfig,
        transformers.LlamaForCausalLM,
        dict(tie_word_embeddings=True, rope_scaling=LLAMA3, rope_theta=10000.0),
    ),
    "qwen2-bias": (
        transformers.Qwen2Config,
        transformers.Qwen2ForCausalLM,
        dict(tie_word_embeddings=False, rope_theta=1000000.0),
    ),
    "qwen3-qknorm-headdim": (
        transformers.Qwen3Config,
        transformers.Qwen3ForCausalLM,
        dict(head_dim=32, tie_word_embeddings=True, rope_theta=1000000.0),
    ),
    "mistral": (
        transformers.MistralConfig,
        transformers.MistralForCausalLM,
        dict(tie_word_embeddings=False, sliding_window=None, head_dim=16),
    ),
    # sliding windows shorter than the 48-token test sequences (astrai/model/window_config.py)
    "mistral-window": (
        transformers.MistralConfig,
        transformers.MistralForCausalLM,
        dict(sliding_window=8, head_dim=16),
    ),
    "qwen2-window-upper-layers": (
        transformers.Qwen2Config,
        transformers.Qwen2ForCausalLM,
        dict(use_sliding_window=True, sliding_window=8, max_window_layers=1),
    ),
    "qwen3-window-all-layers": (
        transformers.Qwen3Config,
        transformers.Qwen3ForCausalLM,
        dict(use_sliding_window=True, sliding_window=5, max_window_layers=0),
    ),
    "llama-linear": (
        transformers.LlamaConfig,
        transformers.LlamaForCausalLM,
        dict(rope_scaling={"rope_type": "linear", "factor": 2.0}),
    ),
    "llama-dynamic": (
        transformers.LlamaConfig,
        transformers.LlamaForCausalLM,
        dict(rope_scaling={"rope_type": "dynamic", "factor": 2.0}, max_position_embeddings=32),
    ),
    "llama-yarn": (
        transformers.LlamaConfig,
        transformers.LlamaForCausalLM,
        dict(
            rope_scaling={
                "rope_type": "yarn",
                "factor": 4.0,
                "original_max_position_embeddings": 16,
            }
        ),
    ),
    "llama-attention-bias": (
        transformers.LlamaConfig,
        transformers.LlamaForCausalLM,
        dict(attention_bias=True),
    ),
    "olmo2": (
        transformers.Olmo2Config,
        transformers.Olmo2ForCausalLM,
        dict(tie_word_embeddings=False, pad_token_id=1, bos_token_id=None, eos_token_id=2),
    ),
    "olmo2-bias-tied": (
        transformers.Olmo2Config,
        transformers.Olmo2ForCausalLM,
        dict(tie_word_embeddings=True, attention_bias=True, pad_token_id=1, eos_token_id=2),
    ),
    "phi3": (
        transformers.Phi3Config,
        transformers.Phi3ForCausalLM,
        dict(pad_token_id=1, bos_token_id=0, eos_token_id=2),
    ),
    "phi3-window": (  # Phi-3-mini-4k's shape: one window on every layer
        transformers.Phi3Config,
        transformers.Phi3ForCausalLM,
        dict(pad_token_id=1, bos_token_id=0, eos_token_id=2, sliding_window=8),
    ),
    "phi4-mini-partial-rotary": (
        transformers.Phi3Config,
        transformers.Phi3ForCausalLM,
        dict(
            pad_token_id=1,
            bos_token_id=0,
            eos_token_id=2,
            tie_word_embeddings=True,
            rope_parameters={
                "rope_type": "default",
                "rope_theta": 10000.0,
                "partial_rotary_factor": 0.75,
            },
        ),
    ),
}


def build_hf(case: str):
    config_cls, model_cls, extra = CASES[case]
    config = config_cls(**{**BASE, **extra})
    torch.manual_seed(0)
    model = model_cls(config).eval()
    # HF initialises norms to 1 and biases to 0; perturb everything so each tensor matters.
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return model


def ids(seq: int = 48) -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, seq), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("case", sorted(CASES))
def test_hf_directory_loads_with_equal_logits(case, tmp_path):
    hf = build_hf(case)
    hf.save_pretrained(tmp_path)
    ours = AutoModel.from_pretrained(tmp_path)
    assert isinstance(ours, Transformer)
    x = ids()
    with torch.no_grad():
        expected = hf(x).logits
        got = ours(x)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)


@pytest.mark.parametrize("case", sorted(CASES))
def test_export_loads_in_transformers_with_equal_logits(case, tmp_path):
    hf = build_hf(case)
    hf.save_pretrained(tmp_path / "hf")
    ours = AutoModel.from_pretrained(tmp_path / "hf")
    save_pretrained(ours, tmp_path / "export", hf_format=True)
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "export").eval()
    assert type(back).__name__ == type(hf).__name__
    x = ids()
    with torch.no_grad():
        torch.testing.assert_close(back(x).logits, ours(x), atol=1e-5, rtol=0)


def test_native_directory_round_trip_and_sharding(tmp_path):
    cfg = ModelConfig(**{**BASE, "qk_norm": True, "attention_bias": True, "o_proj_bias": True})
    torch.manual_seed(0)
    model = Transformer(cfg).eval()
    save_pretrained(model, tmp_path, max_shard_size=40_000)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    shards = sorted({v for v in index["weight_map"].values()})
    assert len(shards) > 1 and all((tmp_path / s).is_file() for s in shards)
    assert not (tmp_path / "model.safetensors").exists()
    back = AutoModel.from_pretrained(tmp_path)
    assert back.config == cfg
    x = ids()
    with torch.no_grad():
        assert torch.equal(back(x), model(x))
    # Saving again unsharded replaces the shards instead of leaving stale files behind.
    save_pretrained(model, tmp_path)
    assert (tmp_path / "model.safetensors").is_file()
    assert not list(tmp_path.glob("model-*.safetensors"))
    assert not (tmp_path / "model.safetensors.index.json").exists()
    with torch.no_grad():
        assert torch.equal(AutoModel.from_pretrained(tmp_path)(x), model(x))


def test_load_in_other_dtype(tmp_path):
    hf = build_hf("qwen3-qknorm-headdim")
    hf.save_pretrained(tmp_path)
    ours = AutoModel.from_pretrained(tmp_path, dtype=torch.bfloat16)
    assert {p.dtype for p in ours.parameters()} == {torch.bfloat16}
    with torch.no_grad():
        out = ours(ids(8))
    assert out.dtype == torch.bfloat16 and torch.isfinite(out).all()


@pytest.mark.parametrize("case", ["mistral-window", "qwen2-window-upper-layers"])
def test_sliding_window_config_round_trips_through_hf(case, tmp_path):
    hf = build_hf(case)
    hf.save_pretrained(tmp_path / "hf")
    ours = AutoModel.from_pretrained(tmp_path / "hf")
    expected = hf.config.layer_types if case.startswith("qwen2") else None
    assert ours.config.sliding_window == 8
    assert ours.config.layer_types == expected
    save_pretrained(ours, tmp_path / "export", hf_format=True)
    again = AutoModel.from_pretrained(tmp_path / "export")
    assert again.config.to_dict() == ours.config.to_dict()
    back = transformers.AutoConfig.from_pretrained(tmp_path / "export")
    assert back.sliding_window == 8
    assert getattr(back, "layer_types", None) == getattr(hf.config, "layer_types", None)
