"""Logit parity with `transformers` for DeepSeek-V2 and -V3 (MLA attention, DeepSeek MoE), both
directions, with and without q_lora_rank, with YaRN (mscale) rope and the routing exercised."""

import json

import pytest
import torch
import transformers
from hf_helpers import assert_export_round_trip

from astrai.model import AutoModel, ConfigError, Transformer, preset, save_pretrained
from astrai.model.hub import config_to_hf

VOCAB = 256
YARN = dict(
    rope_type="yarn",
    rope_theta=10000.0,
    factor=4.0,
    original_max_position_embeddings=16,
    mscale=0.707,
    mscale_all_dim=0.707,
    beta_fast=32,
    beta_slow=1,
)
BASE = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=4,
    kv_lora_rank=32,
    qk_nope_head_dim=16,
    qk_rope_head_dim=8,
    v_head_dim=12,
    max_position_embeddings=64,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
    rope_parameters=YARN,
    moe_intermediate_size=24,
    n_routed_experts=8,
    num_experts_per_tok=2,
    n_shared_experts=1,
    first_k_dense_replace=1,
    routed_scaling_factor=1.5,
)
CASES = {
    "v2-greedy": ("v2", dict(q_lora_rank=None, topk_method="greedy")),
    "v2-group-qlora": (
        "v2",
        dict(q_lora_rank=24, topk_method="group_limited_greedy", n_group=4, topk_group=2),
    ),
    "v3-qlora": ("v3", dict(q_lora_rank=24, n_group=4, topk_group=2, norm_topk_prob=True)),
    "v3-no-qlora": ("v3", dict(q_lora_rank=None, n_group=2, topk_group=1, norm_topk_prob=False)),
    "v3-dense": ("v3", dict(q_lora_rank=24, first_k_dense_replace=3, n_group=1, topk_group=1)),
}
CLASSES = {
    "v2": (transformers.DeepseekV2Config, transformers.DeepseekV2ForCausalLM),
    "v3": (transformers.DeepseekV3Config, transformers.DeepseekV3ForCausalLM),
}


def build_hf(case: str):
    version, extra = CASES[case]
    config_cls, model_cls = CLASSES[version]
    config = config_cls(**{**BASE, **extra})
    torch.manual_seed(0)
    model = model_cls(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                p.normal_(0.0, 1.0)  # router choices far from ties
            elif name.endswith("e_score_correction_bias"):
                p.normal_(0.0, 0.5)
            else:
                p.add_(torch.randn_like(p) * 0.05)
    return model


def ids(seq: int = 40) -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, seq), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("case", sorted(CASES))
def test_deepseek_directory_loads_with_equal_logits(case, tmp_path):
    hf = build_hf(case)
    hf.save_pretrained(tmp_path)
    ours = AutoModel.from_pretrained(tmp_path)
    cfg = ours.config
    assert cfg.attention_type == "mla"
    assert cfg.q_lora_rank == CASES[case][1]["q_lora_rank"]
    dense = case.endswith("dense")
    assert [cfg.is_moe_layer(i) for i in range(3)] == [False, not dense, not dense]
    x = ids()  # 80 tokens, 8 experts: every expert gets traffic
    with torch.no_grad():
        torch.testing.assert_close(ours(x), hf(x).logits, atol=1e-5, rtol=0)


@pytest.mark.parametrize("case", sorted(CASES))
def test_deepseek_export_loads_in_transformers_with_equal_logits(case, tmp_path):
    assert_export_round_trip(build_hf(case), tmp_path, ids())


def test_fresh_tiny_mla_exports_and_round_trips(tmp_path):
    torch.manual_seed(0)
    model = Transformer(preset("tiny-mla")).eval()
    save_pretrained(model, tmp_path / "hf", hf_format=True)
    data = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert data["architectures"] == ["DeepseekV3ForCausalLM"]
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    x = torch.randint(0, 512, (2, 30), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        torch.testing.assert_close(back(x).logits, model(x), atol=1e-5, rtol=0)
    save_pretrained(model, tmp_path / "native")  # our own directory: same tensors, our config
    for path in ("hf", "native"):
        again = AutoModel.from_pretrained(tmp_path / path)
        with torch.no_grad():
            torch.testing.assert_close(again(x), model(x), atol=0, rtol=0)


def test_mla_moe_without_a_deepseek_equivalent_is_refused():
    cfg = preset(
        "tiny-mla", num_experts=4, num_experts_per_tok=2, router_scoring="sigmoid"
    )  # sigmoid with greedy top-k and no correction bias: neither V2 nor V3
    with pytest.raises(ConfigError, match="DeepSeek"):
        config_to_hf(cfg)


def test_mtp_layers_are_skipped_and_unsupported_rope_layout_refused(tmp_path):
    from safetensors.torch import load_file, save_file

    hf = build_hf("v3-qlora")
    hf.save_pretrained(tmp_path)
    file = tmp_path / "model.safetensors"
    tensors = load_file(str(file))
    tensors["model.layers.3.eh_proj.weight"] = torch.zeros(4, 4)  # V3's next-token-prediction layer
    save_file(tensors, str(file), metadata={"format": "pt"})
    ours = AutoModel.from_pretrained(tmp_path)
    with torch.no_grad():
        torch.testing.assert_close(ours(ids()), hf(ids()).logits, atol=1e-5, rtol=0)
    data = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**data, "rope_interleave": False}))
    with pytest.raises(ConfigError, match="rope_interleave"):
        AutoModel.from_pretrained(tmp_path)
