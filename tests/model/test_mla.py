"""Multi-head latent attention: config validation, masks of the dense forward, softmax scale."""

import math

import pytest
import torch

from astrai.model import PRESETS, ConfigError, ModelConfig, Transformer, preset
from astrai.model.mla import MLAttention
from astrai.model.mla_config import kv_bytes_per_token, mla_softmax_scale


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        (dict(kv_lora_rank=None), "ModelConfig.kv_lora_rank"),
        (dict(qk_nope_head_dim=None), "ModelConfig.qk_nope_head_dim"),
        (dict(v_head_dim=None), "ModelConfig.v_head_dim"),
        (dict(qk_rope_head_dim=7), "ModelConfig.qk_rope_head_dim"),
        (dict(q_lora_rank=0), "ModelConfig.q_lora_rank"),
        (dict(head_dim=16), "ModelConfig.head_dim"),
        (dict(attention_type="mha"), "ModelConfig.attention_type"),
    ],
)
def test_bad_mla_config_is_refused_naming_the_field(overrides, field):
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        ModelConfig.from_dict({**PRESETS["tiny-mla"], **overrides})


def test_mla_head_dim_is_the_rotary_dim_and_json_round_trips():
    cfg = preset("tiny-mla")
    assert cfg.head_dim == cfg.qk_rope_head_dim
    assert ModelConfig.from_json(cfg.to_json()) == cfg


def test_softmax_scale_includes_yarn_mscale():
    cfg = preset("tiny-mla")
    assert mla_softmax_scale(cfg) == pytest.approx(24**-0.5)
    yarn = dict(rope_type="yarn", factor=40.0, mscale=1.0, mscale_all_dim=1.0)
    cfg = preset("tiny-mla", rope_scaling=yarn)
    m = 0.1 * math.log(40.0) + 1.0
    assert mla_softmax_scale(cfg) == pytest.approx(24**-0.5 * m * m)


def test_kv_bytes_per_token_is_latent_sized():
    cfg = preset("tiny-mla")
    assert kv_bytes_per_token(cfg, 2) == 2 * (32 + 8) * 2
    dense = preset("tiny")
    assert kv_bytes_per_token(dense, 2) == 2 * 2 * 2 * 16 * 2


@pytest.fixture(scope="module")
def model() -> Transformer:
    torch.manual_seed(0)
    return Transformer(preset("tiny-mla", q_lora_rank=None)).eval()


def test_blocks_use_mla(model):
    assert all(isinstance(layer.self_attn, MLAttention) for layer in model.layers)


def test_packed_documents_equal_separate_forwards(model):
    a = torch.randint(0, 512, (1, 9), generator=torch.Generator().manual_seed(0))
    b = torch.randint(0, 512, (1, 7), generator=torch.Generator().manual_seed(1))
    packed = torch.cat([a, b], dim=1)
    pos = torch.cat([torch.arange(9), torch.arange(7)])[None]
    with torch.no_grad():
        out = model(packed, position_ids=pos)
        torch.testing.assert_close(out[:, :9], model(a), atol=1e-5, rtol=0)
        torch.testing.assert_close(out[:, 9:], model(b), atol=1e-5, rtol=0)


def test_right_padding_does_not_change_real_tokens(model):
    x = torch.randint(0, 512, (1, 10), generator=torch.Generator().manual_seed(2))
    padded = torch.cat([x, torch.zeros(1, 5, dtype=torch.long)], dim=1)
    mask = torch.cat([torch.ones(1, 10), torch.zeros(1, 5)], dim=1).long()
    with torch.no_grad():
        out = model(padded, attention_mask=mask)
        torch.testing.assert_close(out[:, :10], model(x), atol=1e-5, rtol=0)


def test_mla_trains():
    torch.manual_seed(0)
    model = Transformer(preset("tiny-mla"))
    x = torch.randint(0, 512, (2, 12))
    loss = torch.nn.functional.cross_entropy(model(x)[:, :-1].flatten(0, 1), x[:, 1:].flatten())
    loss.backward()
    attn = model.layers[0].self_attn
    for p in (attn.q_a_proj.weight, attn.kv_a_proj_with_mqa.weight, attn.kv_b_proj.weight):
        assert p.grad is not None and p.grad.abs().sum() > 0
