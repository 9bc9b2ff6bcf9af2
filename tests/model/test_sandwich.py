"""The sandwich block (`astrai.model.sandwich`) against transformers' `Gemma3DecoderLayer`
with the same weights: the four norms, GeGLU and the query_pre_attn_scalar attention."""

import torch
import transformers
from transformers.models.gemma3.modeling_gemma3 import Gemma3DecoderLayer

from astrai.model import ModelConfig, SandwichBlock
from astrai.model.rope import RotaryEmbedding

SIZES = dict(
    vocab_size=97,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=1,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    query_pre_attn_scalar=24,
)


def test_sandwich_block_equals_transformers_gemma3_layer():
    hf_cfg = transformers.Gemma3TextConfig(**SIZES, layer_types=["full_attention"])
    hf_cfg._attn_implementation = "eager"
    ref = Gemma3DecoderLayer(hf_cfg, 0).eval()
    cfg = ModelConfig(
        **SIZES,
        norm_position="sandwich",
        norm_type="gemma",
        qk_norm=True,
        hidden_act="gelu_pytorch_tanh",
    )
    ours = SandwichBlock(cfg, 0).eval()
    torch.manual_seed(0)
    with torch.no_grad():
        for p in ref.parameters():
            p.normal_(0, 0.3)
    ours.load_state_dict(ref.state_dict())  # HF's names are ours
    b, s = 2, 7
    x = torch.randn(b, s, 32, generator=torch.Generator().manual_seed(1))
    pos = torch.arange(s).expand(b, s)
    cos, sin = RotaryEmbedding(cfg)(pos)
    causal = torch.full((s, s), float("-inf")).triu(1).expand(b, 1, s, s)
    with torch.no_grad():
        expected = ref(
            x,
            position_embeddings=(torch.cat((cos, cos), -1), torch.cat((sin, sin), -1)),
            attention_mask=causal,
        )
        torch.testing.assert_close(ours(x, cos, sin), expected, atol=1e-5, rtol=0)
