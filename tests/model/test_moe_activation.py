"""The experts' activations (`astrai.model.moe_activation`) against transformers: SwiGLU as
`silu(gate) * up`, GPT-OSS's clamped variant as `GptOssExperts._apply_gate` computes it on
the same gate/up values (interleaved there, gate half first here), clamps crossed both ways."""

from __future__ import annotations

import torch
import torch.nn.functional as F
import transformers
from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

from astrai.model import ModelConfig
from astrai.model.moe_activation import ClampedSwiGLU, expert_activation, swiglu

LIMIT = 0.9


def test_clamped_swiglu_equals_transformers_gpt_oss_gate():
    hf_cfg = transformers.GptOssConfig(
        hidden_size=8, intermediate_size=6, num_local_experts=2, swiglu_limit=LIMIT
    )
    experts = GptOssExperts(hf_cfg)
    gate, up = torch.randn(2, 5, 6) * 2, torch.randn(2, 5, 6) * 2
    assert (gate > LIMIT).any() and (up < -LIMIT).any() and (up > LIMIT).any()
    interleaved = torch.stack([gate, up], dim=-1).flatten(-2)
    expected = experts._apply_gate(interleaved)
    got = ClampedSwiGLU(LIMIT, hf_cfg.swiglu_alpha)(torch.cat([gate, up], dim=-1))
    torch.testing.assert_close(got, expected)


def test_the_config_chooses_the_activation():
    base = dict(vocab_size=8, hidden_size=8, intermediate_size=8, num_hidden_layers=1)
    base.update(num_attention_heads=2, num_experts=2, num_experts_per_tok=1)
    assert expert_activation(ModelConfig(**base)) is swiglu
    clamped = expert_activation(ModelConfig(**base, swiglu_limit=LIMIT, swiglu_alpha=1.5))
    assert isinstance(clamped, ClampedSwiGLU) and (clamped.limit, clamped.alpha) == (LIMIT, 1.5)
    x = torch.randn(3, 8)
    torch.testing.assert_close(swiglu(x), F.silu(x[:, :4]) * x[:, 4:])
