"""The server answering through the OpenAI SDK with a mixture-of-experts model, a
multi-head latent attention (MLA) model, an OLMo 2 (post-norm), a Phi-4-mini-like
(partial rotary), a GPT-OSS-like model (attention sinks, biased experts with the clamped
SwiGLU, a sliding window shorter than the prompt on one of two layers) and a Gemma 3 (sandwich
blocks, per-layer-type RoPE) model: the same greedy text as full recomputation."""

from __future__ import annotations

import openai
import pytest
import torch

from astrai.inference import InferenceEngine
from astrai.model import AutoModel
from astrai.serve import ServerThread, ServeSettings, create_app
from astrai.tokenizer import AutoTokenizer

SMALL = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    max_position_embeddings=512,
    initializer_range=0.15,
)
FAMILIES = {
    "moe": dict(
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=48,
        num_shared_experts=1,
        shared_expert_gate=True,
    ),
    "mla": dict(
        attention_type="mla",
        q_lora_rank=32,
        kv_lora_rank=32,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=16,
    ),
    # OLMo 2: post-norm blocks, q/k norm over the whole projection
    "olmo2": dict(norm_position="post", qk_norm=True, qk_norm_scope="projection"),
    # Phi-4-mini: RoPE on the first 3/4 of each head (Phi-3's fused projections are split on
    # import, so the served model is this one)
    "phi3": dict(partial_rotary_factor=0.75, hf_model_type="phi3"),
    "gpt_oss": dict(
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=48,
        norm_topk_prob=True,
        attention_bias=True,
        o_proj_bias=True,
        attention_sinks=True,
        router_bias=True,
        expert_bias=True,
        swiglu_limit=1.0,
        sliding_window=4,
        layer_types=["sliding_attention", "full_attention"],
        hf_model_type="gpt_oss",
    ),
    # Gemma 3: sandwich blocks of (1 + w) norms, scaled embeddings, GeGLU, a window of 4 on
    # layer 0 with its own RoPE base (the prompt and answer run past it)
    "gemma3": dict(
        norm_position="sandwich",
        norm_type="gemma",
        qk_norm=True,
        scale_embeddings=True,
        hidden_act="gelu_pytorch_tanh",
        query_pre_attn_scalar=24.0,
        sliding_window=4,
        layer_types=["sliding_attention", "full_attention"],
        rope_local_base_freq=500.0,
    ),
}


def _is_family(model, family: str) -> bool:
    if family == "moe":
        return [type(b.mlp).__name__ for b in model.layers] == ["MoE", "MoE"]
    if family == "olmo2":
        return [type(b).__name__ for b in model.layers] == ["PostNormBlock"] * 2
    if family == "phi3":
        return model.config.rotary_dim() == 12
    if family == "gpt_oss":
        attn = model.layers[0].self_attn
        return attn.sinks is not None and attn.window == 4 and model.config.swiglu_limit == 1.0
    if family == "gemma3":
        return [type(b).__name__ for b in model.layers] == ["SandwichBlock"] * 2
    return model.config.attention_type == "mla"


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def served(request, tmp_path_factory, save_model_dir, stdlib_tokenizer):
    family = request.param
    path = save_model_dir(
        tmp_path_factory.mktemp(family), stdlib_tokenizer, **SMALL, **FAMILIES[family]
    )
    model = AutoModel.from_pretrained(path)
    tok = AutoTokenizer.from_pretrained(path)
    eng = InferenceEngine(model, tok, max_batch_size=4, max_seq_len=256, cache_mode="paged")
    with ServerThread(create_app(eng, ServeSettings())) as srv:
        yield family, srv.url, model, tok
    eng.shutdown()


def test_openai_sdk_answers_from_the_model_family(served):
    family, url, model, tok = served
    assert _is_family(model, family)
    with openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=60) as client:
        r = client.completions.create(
            model="astrai", prompt="def f(x):", max_tokens=6, temperature=0
        )
        chat = client.chat.completions.create(
            model="astrai", messages=[{"role": "user", "content": "hi"}], max_tokens=4
        )
    assert chat.choices[0].message.role == "assistant"
    assert chat.usage.completion_tokens >= 1
    # The served greedy text equals greedy decoding by full recomputation of the prompt.
    ids = list(tok.encode("def f(x):"))
    assert r.usage.prompt_tokens == len(ids)
    out: list[int] = []
    with torch.no_grad():
        for _ in range(r.usage.completion_tokens):
            out.append(int(model(torch.tensor([ids + out]))[0, -1].argmax()))
    assert r.choices[0].text == tok.decode(out)
