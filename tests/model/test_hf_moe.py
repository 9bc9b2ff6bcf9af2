"""Logit parity with `transformers` for Mixtral, Qwen2-MoE and Qwen3-MoE, both directions,
with the routing exercised (more tokens than experts, router logits spread so there are no ties)."""

import json

import pytest
import torch
import transformers
from hf_helpers import assert_export_round_trip

from astrai.model import (
    AutoModel,
    ConfigError,
    ModelConfig,
    Transformer,
    preset,
    save_pretrained,
)
from astrai.model.hub import config_to_hf

VOCAB = 256
BASE = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
)
CASES = {
    "mixtral": (
        transformers.MixtralConfig,
        transformers.MixtralForCausalLM,
        dict(num_local_experts=5, num_experts_per_tok=2, intermediate_size=48, sliding_window=None),
    ),
    "qwen2_moe": (
        transformers.Qwen2MoeConfig,
        transformers.Qwen2MoeForCausalLM,
        dict(
            num_experts=6,
            num_experts_per_tok=2,
            intermediate_size=80,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=48,
            norm_topk_prob=False,
            mlp_only_layers=[1],
        ),
    ),
    "qwen3_moe": (
        transformers.Qwen3MoeConfig,
        transformers.Qwen3MoeForCausalLM,
        dict(
            num_experts=6,
            num_experts_per_tok=3,
            intermediate_size=80,
            moe_intermediate_size=32,
            norm_topk_prob=True,
            decoder_sparse_step=2,
            head_dim=32,
            tie_word_embeddings=True,
        ),
    ),
}
# Sliding windows shorter than the 40-token test sequences, as each family's transformers model
# reads them: Mixtral's and Qwen3-MoE's on every layer, Qwen2-MoE's on the even layers below
# `max_window_layers`.
WINDOWS = {
    "mixtral": dict(sliding_window=8),
    "qwen2_moe": dict(use_sliding_window=True, sliding_window=8, max_window_layers=3),
    "qwen3_moe": dict(use_sliding_window=True, sliding_window=5),
}


def spread_router(model: torch.nn.Module) -> None:
    """Router weights large enough that top-k choices are far from ties."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("mlp.gate.weight") or name.endswith("block_sparse_moe.gate.weight"):
                p.normal_(0.0, 1.0)


def build_hf(case: str, **overrides):
    config_cls, model_cls, extra = CASES[case]
    config = config_cls(**{**BASE, **extra, **overrides})
    torch.manual_seed(0)
    model = model_cls(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    spread_router(model)
    return model


def ids(seq: int = 40) -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, seq), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("case", sorted(CASES))
def test_hf_moe_directory_loads_with_equal_logits(case, tmp_path):
    hf = build_hf(case)
    hf.save_pretrained(tmp_path)
    ours = AutoModel.from_pretrained(tmp_path)
    assert isinstance(ours, Transformer)
    cfg = ours.config
    assert (cfg.num_experts, cfg.num_experts_per_tok) == {
        "mixtral": (5, 2),
        "qwen2_moe": (6, 2),
        "qwen3_moe": (6, 3),
    }[case]
    sparse = [cfg.is_moe_layer(i) for i in range(cfg.num_hidden_layers)]
    assert (
        sparse
        == {
            "mixtral": [True] * 3,
            "qwen2_moe": [True, False, True],
            "qwen3_moe": [False, True, False],
        }[case]
    )
    x = ids()
    with torch.no_grad():
        expected = hf(x).logits
        got = ours(x)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)


@pytest.mark.parametrize("case", sorted(CASES))
def test_moe_export_loads_in_transformers_with_equal_logits(case, tmp_path):
    assert_export_round_trip(build_hf(case), tmp_path, ids())


@pytest.mark.parametrize("case", sorted(WINDOWS))
def test_moe_sliding_window_loads_and_exports_with_equal_logits(case, tmp_path):
    hf = build_hf(case, **WINDOWS[case])
    hf.save_pretrained(tmp_path / "hf")
    ours = AutoModel.from_pretrained(tmp_path / "hf")
    cfg = ours.config
    assert cfg.sliding_window == WINDOWS[case]["sliding_window"]
    windowed = [cfg.layer_window(i) is not None for i in range(cfg.num_hidden_layers)]
    assert windowed == ([True, False, True] if case == "qwen2_moe" else [True] * 3)
    x = ids()  # 40 tokens: past every window
    with torch.no_grad():
        torch.testing.assert_close(ours(x), hf(x).logits, atol=1e-5, rtol=0)
    assert_export_round_trip(hf, tmp_path / "rt", x)
    save_pretrained(ours, tmp_path / "out", hf_format=True)
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    assert back.config.model_type == case
    with torch.no_grad():
        torch.testing.assert_close(back(x).logits, ours(x), atol=1e-5, rtol=0)


def test_moe_export_refuses_windows_its_family_cannot_hold():
    """Without shared experts or q/k norm the model exports as Mixtral, whose one
    `sliding_window` covers every layer: a window on some layers only is refused."""
    fields = preset("tiny-moe").to_dict() | dict(
        num_shared_experts=0, shared_expert_gate=False, norm_topk_prob=True, mlp_only_layers=[]
    )
    mixtral = ModelConfig.from_dict(fields | dict(sliding_window=4))
    assert config_to_hf(mixtral)["model_type"] == "mixtral"
    assert config_to_hf(mixtral)["sliding_window"] == 4
    some = ModelConfig.from_dict(
        fields | dict(sliding_window=4, layer_types=["sliding_attention", "full_attention"])
    )
    with pytest.raises(ConfigError, match="layer_types: mixtral holds one window"):
        config_to_hf(some)


def test_fresh_tiny_moe_exports_as_qwen2_moe(tmp_path):
    torch.manual_seed(0)
    model = Transformer(preset("tiny-moe")).eval()
    spread_router(model)
    save_pretrained(model, tmp_path, hf_format=True)
    data = json.loads((tmp_path / "config.json").read_text())
    assert data["model_type"] == "qwen2_moe" and data["mlp_only_layers"] == [0]
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    x = torch.randint(0, 512, (2, 24), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        torch.testing.assert_close(back(x).logits, model(x), atol=1e-5, rtol=0)
    again = AutoModel.from_pretrained(tmp_path)
    with torch.no_grad():
        torch.testing.assert_close(again(x), model(x), atol=1e-6, rtol=0)


def test_native_moe_directory_round_trip(tmp_path):
    torch.manual_seed(0)
    model = Transformer(
        preset(
            "tiny-moe",
            router_scoring="sigmoid",
            n_group=2,
            topk_group=1,
            router_topk_method="noaux_tc",
            router_correction_bias=True,
            routed_scaling_factor=2.5,
        )
    ).eval()
    save_pretrained(model, tmp_path)
    back = AutoModel.from_pretrained(tmp_path)
    assert back.config == model.config
    x = torch.randint(0, 512, (1, 16))
    with torch.no_grad():
        assert torch.equal(back(x), model(x))
    with pytest.raises(ConfigError, match="no Mixtral / Qwen-MoE equivalent"):
        config_to_hf(model.config)
