"""Gemma 3 text (`astrai.model.hf_gemma3`): logits equal transformers' `Gemma3ForCausalLM`
both ways on sequences longer than the sliding window (per-type RoPE, sandwich blocks,
(1 + w) norms, scaled embeddings, GeGLU, query_pre_attn_scalar), the older config spelling,
a vision-language checkpoint's text model, the engine's greedy tokens against `generate`, a LoRA training, and the refusals."""

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
from astrai.model.sandwich import SandwichBlock

WINDOW = 8
TYPES = ["sliding_attention", "full_attention", "sliding_attention", "full_attention"]
LINEAR = {"rope_type": "linear", "factor": 2.0, "rope_theta": 20000.0}
CASES = {
    "gemma3": {},
    # Gemma 3 4b/12b/27b: linear scaling on the full layers only
    "gemma3-linear-full-rope": dict(
        rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 500.0},
            "full_attention": LINEAR,
        }
    ),
}


def build_hf(case: str, vocab: int = 320) -> transformers.Gemma3ForCausalLM:
    sizes = {**SIZES, "num_hidden_layers": len(TYPES)}
    config = transformers.Gemma3TextConfig(
        vocab_size=vocab,
        pad_token_id=0,
        eos_token_id=1,
        bos_token_id=2,
        head_dim=16,
        query_pre_attn_scalar=24,  # != head_dim: the attention scale matters
        sliding_window=WINDOW,
        layer_types=TYPES,
        **{"rope_theta": 20000.0, "rope_local_base_freq": 500.0, **sizes, **CASES[case]},
    )
    torch.manual_seed(0)
    model = transformers.Gemma3ForCausalLM(config).eval()
    with torch.no_grad():  # norms start at 0 in HF: random ones exercise the (1 + w)
        for name, p in model.named_parameters():
            p.add_(torch.randn_like(p) * (0.3 if "norm" in name else 0.05))
    return model


def ids(seq: int = 40) -> torch.Tensor:
    return torch.randint(0, 320, (2, seq), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("case", sorted(CASES))
def test_gemma3_loads_with_equal_logits_past_the_window(case, tmp_path):
    hf = build_hf(case)
    hf.save_pretrained(tmp_path)
    ours = AutoModel.from_pretrained(tmp_path)
    cfg = ours.config
    assert (cfg.sliding_window, cfg.layer_types, cfg.rope_local_base_freq) == (WINDOW, TYPES, 500)
    assert cfg.query_pre_attn_scalar == 24 and cfg.hidden_act == "gelu_pytorch_tanh"
    assert all(isinstance(b, SandwichBlock) for b in ours.layers)
    x = ids()
    with torch.no_grad():
        torch.testing.assert_close(ours(x), hf(x).logits, atol=1e-5, rtol=0)


@pytest.mark.parametrize("case", sorted(CASES))
def test_gemma3_export_loads_in_transformers_with_equal_logits(case, tmp_path):
    assert_export_round_trip(build_hf(case), tmp_path, ids())


def test_older_config_spelling_loads_as_transformers_reads_it(tmp_path):
    """rope_theta / rope_local_base_freq / rope_scaling / sliding_window_pattern, as Gemma 3's
    published config.json files spell them (no layer_types, no rope_parameters)."""
    hf = build_hf("gemma3")
    hf.save_pretrained(tmp_path)
    data = json.loads((tmp_path / "config.json").read_text())
    for key in ("layer_types", "rope_parameters", "_sliding_window_pattern"):
        data.pop(key)
    data.update(
        rope_theta=20000.0,
        rope_local_base_freq=700.0,
        rope_scaling={"rope_type": "linear", "factor": 4.0},
        sliding_window_pattern=3,  # layers 2 (and 5, ...) attend fully
    )
    (tmp_path / "config.json").write_text(json.dumps(data))
    ref = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    ours = AutoModel.from_pretrained(tmp_path)
    assert ours.config.layer_types == ref.config.layer_types
    assert ours.config.rope_scaling == {"rope_type": "linear", "factor": 4.0}
    x = ids()
    with torch.no_grad():
        torch.testing.assert_close(ours(x), ref(x).logits, atol=1e-5, rtol=0)


@pytest.mark.parametrize("tied", [True, False])
def test_vision_language_checkpoint_loads_as_its_text_model(tied, tmp_path):
    """A `Gemma3ForConditionalGeneration` directory (model_type "gemma3"): its text model,
    with the vision tower left out, gives transformers' logits for text-only input."""
    text = build_hf("gemma3").config.to_dict()
    vision = dict(
        model_type="siglip_vision_model",
        hidden_size=32,
        intermediate_size=37,
        num_hidden_layers=1,
        num_attention_heads=2,
        image_size=28,
        patch_size=14,
    )
    config = transformers.Gemma3Config(
        text_config=text,
        vision_config=vision,
        mm_tokens_per_image=4,
        image_token_index=300,
        boi_token_index=301,
        eoi_token_index=302,
        tie_word_embeddings=tied,
    )
    torch.manual_seed(0)
    hf = transformers.Gemma3ForConditionalGeneration(config).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            p.add_(torch.randn_like(p) * (0.3 if "norm" in name else 0.05))
    hf.save_pretrained(tmp_path)
    ours = AutoModel.from_pretrained(tmp_path)
    assert ours.config.hf_model_type == "gemma3_text"
    assert ours.config.tie_word_embeddings == tied
    x = ids()
    with torch.no_grad():
        torch.testing.assert_close(ours(x), hf(input_ids=x).logits, atol=1e-5, rtol=0)


def test_engine_greedy_equals_transformers_generate(tmp_path, stdlib_tokenizer):
    hf = build_hf("gemma3-linear-full-rope", len(stdlib_tokenizer))
    assert_engine_greedy_equals_hf(hf, tmp_path, stdlib_tokenizer)


def test_lora_trains_on_gemma3(tmp_path):
    assert_lora_trains(build_hf("gemma3"), tmp_path)


def _rewrite_config(path, **changes) -> None:
    data = json.loads((path / "config.json").read_text())
    data.update(changes)
    (path / "config.json").write_text(json.dumps(data))


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        (dict(attn_logit_softcapping=50.0), "attn_logit_softcapping=50.0 is not supported"),
        (dict(final_logit_softcapping=30.0), "final_logit_softcapping=30.0 is not supported"),
        (dict(use_bidirectional_attention=True), "use_bidirectional_attention"),
        (dict(hidden_activation="relu"), "hidden_activation='relu'"),
        (dict(model_type="gemma3"), "text_config: a model_type 'gemma3'"),
        (
            dict(
                rope_parameters={
                    "sliding_attention": LINEAR,
                    "full_attention": {"rope_type": "default", "rope_theta": 1e4},
                }
            ),
            "rope_parameters.sliding_attention",
        ),
    ],
)
def test_what_gemma3_cannot_compute_is_refused_naming_the_field(changes, message, tmp_path):
    build_hf("gemma3").save_pretrained(tmp_path)
    _rewrite_config(tmp_path, **changes)
    with pytest.raises(ConfigError, match=message):
        AutoModel.from_pretrained(tmp_path)


def test_gemma_variants_without_a_gemma3_equivalent_are_refused_on_export(tmp_path):
    cfg = ModelConfig(vocab_size=64, **SIZES, norm_type="gemma")  # Llama blocks, Gemma norms
    with pytest.raises(ConfigError, match="export only as Gemma 3"):
        save_pretrained(Transformer(cfg), tmp_path, hf_format=True)


# gemma-3-1b-it's published config.json (transformers 4.50's spelling)
GEMMA3_1B = {
    "architectures": ["Gemma3ForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "attn_logit_softcapping": None,
    "bos_token_id": 2,
    "cache_implementation": "hybrid",
    "eos_token_id": [1, 106],
    "final_logit_softcapping": None,
    "head_dim": 256,
    "hidden_activation": "gelu_pytorch_tanh",
    "hidden_size": 1152,
    "initializer_range": 0.02,
    "intermediate_size": 6912,
    "max_position_embeddings": 32768,
    "model_type": "gemma3_text",
    "num_attention_heads": 4,
    "num_hidden_layers": 26,
    "num_key_value_heads": 1,
    "pad_token_id": 0,
    "query_pre_attn_scalar": 256,
    "rms_norm_eps": 1e-06,
    "rope_local_base_freq": 10000,
    "rope_scaling": None,
    "rope_theta": 1000000,
    "sliding_window": 512,
    "sliding_window_pattern": 6,
    "torch_dtype": "bfloat16",
    "use_cache": True,
    "vocab_size": 262144,
}


def test_published_gemma3_1b_config_translates_as_transformers_reads_it():
    from astrai.model.hub import config_from_hf

    ours = config_from_hf(dict(GEMMA3_1B))
    ref = transformers.Gemma3TextConfig(**GEMMA3_1B)
    assert ours.layer_types == ref.layer_types and ours.layer_types.count("full_attention") == 4
    assert ours.sliding_window == ref.sliding_window == 512
    assert ours.rope_theta == ref.rope_parameters["full_attention"]["rope_theta"]
    assert ours.rope_local_base_freq == ref.rope_parameters["sliding_attention"]["rope_theta"]
    assert ours.rope_scaling is None and ours.tie_word_embeddings
    assert (ours.head_dim, ours.num_key_value_heads, ours.query_pre_attn_scalar) == (256, 1, 256)
    with torch.device("meta"):  # transformers' own count (the tied head once)
        hf = transformers.Gemma3ForCausalLM(ref)
    assert ours.num_parameters() == sum(p.numel() for p in hf.parameters())
