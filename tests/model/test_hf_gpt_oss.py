"""GPT-OSS (`astrai.model.hf_gpt_oss`): a tiny random `GptOssForCausalLM` (alternating
sliding / full layers with a window shorter than the sequences, non-zero sinks and biases, a
SwiGLU limit the activations cross, YaRN with `truncate: false`) imports and exports with
transformers' logits, round-trips through astrai's own directory, serves greedy tokens equal
to transformers' `generate` (paged cache, prefix cache, prompts past the window), trains a
LoRA; exports that GPT-OSS cannot hold and unknown quantisations are refused."""

from __future__ import annotations

import json
import random

import pytest
import torch
import transformers
from hf_helpers import GPT_OSS_WINDOW as WINDOW
from hf_helpers import assert_export_round_trip, assert_lora_trains, hf_greedy
from hf_helpers import build_gpt_oss as build_hf
from safetensors import safe_open

from astrai.extension.cpu_kernels import paged_attention_op
from astrai.model import AutoModel, ConfigError, ModelConfig, save_pretrained
from astrai.model.hub import config_to_hf
from astrai.model.rope import rope_inv_freq


def ids(vocab: int = 256, seq: int = 40) -> torch.Tensor:
    return torch.randint(0, vocab, (2, seq), generator=torch.Generator().manual_seed(1))


def test_gpt_oss_directory_loads_with_equal_logits_and_exports_back(tmp_path):
    hf = build_hf()
    assert_export_round_trip(hf, tmp_path, ids())  # 40 tokens: five windows
    cfg = AutoModel.from_pretrained(tmp_path / "hf").config
    assert cfg.layer_types == ["sliding_attention", "full_attention"] * 2
    assert (cfg.sliding_window, cfg.num_experts, cfg.num_experts_per_tok) == (WINDOW, 4, 2)
    assert cfg.attention_sinks and cfg.router_bias and cfg.expert_bias
    assert cfg.swiglu_limit == 0.8 and cfg.rope_scaling["truncate"] is False
    truncated = ModelConfig.from_dict(
        {**cfg.to_dict(), "rope_scaling": {**cfg.rope_scaling, "truncate": True}}
    )
    assert not torch.equal(rope_inv_freq(cfg)[0], rope_inv_freq(truncated)[0])  # it matters


def test_astrai_directory_round_trips_in_transformers_layout(tmp_path):
    hf = build_hf()
    hf.save_pretrained(tmp_path / "hf")
    ours = AutoModel.from_pretrained(tmp_path / "hf")
    save_pretrained(ours, tmp_path / "own")
    assert json.loads((tmp_path / "own" / "config.json").read_text())["model_type"] == "astrai"
    with safe_open(str(tmp_path / "own" / "model.safetensors"), "pt") as f:
        stored = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
    expected = hf.state_dict()
    assert set(stored) == set(expected)
    for key in ("model.layers.1.mlp.experts.gate_up_proj", "model.layers.1.mlp.router.bias"):
        torch.testing.assert_close(stored[key], expected[key])
    back = AutoModel.from_pretrained(tmp_path / "own")
    with torch.no_grad():
        torch.testing.assert_close(back(ids()), hf(ids()).logits, atol=1e-5, rtol=0)


def test_training_forward_with_padding_and_packed_documents_equals_transformers(tmp_path):
    """Left padding (HF's 2-D attention mask) and two packed documents (position ids that
    restart) give, on the real tokens, the logits of each sequence run alone."""
    hf = build_hf()
    hf.save_pretrained(tmp_path)
    ours = AutoModel.from_pretrained(tmp_path)
    x = ids(seq=30)
    mask = torch.ones_like(x)
    mask[0, :5] = 0
    positions = torch.cat([torch.arange(12), torch.arange(18)])[None].expand(2, -1)
    with torch.no_grad():
        padded = ours(x, attention_mask=mask)
        alone = hf(x[:1, 5:]).logits
        # a padded batch runs other matmul shapes than a lone row: fp32 rounding differs by
        # ~1e-5 on a few logits (seen at 1.2e-5 under xdist); the logit parity itself is 1e-5
        torch.testing.assert_close(padded[0, 5:], alone[0], atol=5e-5, rtol=0)
        packed = ours(x, position_ids=positions)
        torch.testing.assert_close(packed[:, :12], hf(x[:, :12]).logits, atol=1e-5, rtol=0)
        torch.testing.assert_close(packed[:, 12:], hf(x[:, 12:]).logits, atol=1e-5, rtol=0)


BACKENDS = [
    "torch_native",
    pytest.param(
        "cpu",
        marks=pytest.mark.skipif(
            paged_attention_op() is None, reason="the CPU kernel is not built (make setup)"
        ),
    ),
]


@pytest.mark.parametrize("backend", BACKENDS)
def test_engine_greedy_equals_transformers_generate(
    backend, stdlib_tokenizer, tmp_path, monkeypatch
):
    from astrai.inference import InferenceEngine

    hf = build_hf(len(stdlib_tokenizer))
    hf.save_pretrained(tmp_path)
    ours = AutoModel.from_pretrained(tmp_path).eval()
    rng = random.Random(3)
    shared = [rng.randrange(300) for _ in range(13)]  # longer than the window
    first = [shared + [rng.randrange(300) for _ in range(rng.randint(1, 9))] for _ in range(2)]
    second = [shared + [rng.randrange(300) for _ in range(rng.randint(1, 9))] for _ in range(3)]
    monkeypatch.setenv("ASTR_BACKEND", backend)
    kw = dict(max_tokens=10, temperature=0.0, ignore_eos=True)
    with InferenceEngine(
        ours,
        tokenizer=stdlib_tokenizer,
        cache_mode="paged",
        page_size=4,
        prefix_cache=True,
        max_batch_size=4,
        max_seq_len=64,
        start=False,
    ) as eng:
        out = eng.run_batch(first, **kw)
        out += eng.run_batch(second, **kw)
        assert eng.get_stats()["cached_prompt_tokens"] >= 12 * len(second)  # prefix reused
    for prompt, got in zip(first + second, out):
        assert got == hf_greedy(hf, prompt, 10)


def test_lora_trains(tmp_path):
    assert_lora_trains(build_hf(), tmp_path)


def test_exports_gpt_oss_cannot_hold_are_refused(tmp_path):
    hf = build_hf()
    hf.save_pretrained(tmp_path)
    cfg = AutoModel.from_pretrained(tmp_path).config.to_dict()
    for change, needs in (
        (dict(attention_sinks=False), "attention_sinks, router_bias and expert_bias"),
        (dict(mlp_only_layers=[1]), "every layer sparse"),
        (dict(qk_norm=True), "no qk_norm"),
    ):
        config = ModelConfig.from_dict({**cfg, **change})
        with pytest.raises(ConfigError, match=f"GPT-OSS export needs.*{needs}"):
            config_to_hf(config)


def test_unknown_quantisation_is_refused_naming_it(tmp_path):
    build_hf().save_pretrained(tmp_path)
    file = tmp_path / "config.json"
    data = json.loads(file.read_text())
    data["quantization_config"] = {"quant_method": "bitsandbytes"}
    file.write_text(json.dumps(data))
    with pytest.raises(ConfigError, match="quant_method='bitsandbytes'"):
        AutoModel.from_pretrained(tmp_path)


# gpt-oss-20b's published config.json (MXFP4 experts; shapes only, nothing is allocated)
GPT_OSS_20B = {
    "architectures": ["GptOssForCausalLM"],
    "model_type": "gpt_oss",
    "attention_bias": True,
    "eos_token_id": 200002,
    "experts_per_token": 4,
    "head_dim": 64,
    "hidden_act": "silu",
    "hidden_size": 2880,
    "initial_context_length": 4096,
    "intermediate_size": 2880,
    "layer_types": ["sliding_attention", "full_attention"] * 12,
    "max_position_embeddings": 131072,
    "num_attention_heads": 64,
    "num_experts_per_tok": 4,
    "num_hidden_layers": 24,
    "num_key_value_heads": 8,
    "num_local_experts": 32,
    "pad_token_id": 199999,
    "quantization_config": {"quant_method": "mxfp4"},
    "rms_norm_eps": 1e-05,
    "rope_scaling": {
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "factor": 32.0,
        "original_max_position_embeddings": 4096,
        "rope_type": "yarn",
        "truncate": False,
    },
    "rope_theta": 150000,
    "router_aux_loss_coef": 0.9,
    "sliding_window": 128,
    "swiglu_limit": 7.0,
    "tie_word_embeddings": False,
    "vocab_size": 201088,
}


def test_gpt_oss_20b_config_translates_with_transformers_parameter_count():
    from astrai.model.hub import config_from_hf

    cfg = config_from_hf(GPT_OSS_20B)
    assert (cfg.sliding_window, cfg.num_experts, cfg.swiglu_limit) == (128, 32, 7.0)
    assert cfg.rope_theta == 150000 and cfg.rope_scaling["truncate"] is False
    skip = {"architectures", "model_type", "quantization_config", "experts_per_token"}
    hf_cfg = transformers.GptOssConfig(
        **{k: v for k, v in GPT_OSS_20B.items() if k not in skip | {"initial_context_length"}}
    )
    with torch.device("meta"):
        hf = transformers.GptOssForCausalLM(hf_cfg)
    assert cfg.num_parameters() == sum(p.numel() for p in hf.parameters())  # 20.9B
