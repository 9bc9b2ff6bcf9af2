"""The engine serving a multi-head latent attention (MLA) model: latent KV cache, absorbed decode."""

import random

import pytest
import torch

from astrai.inference import InferenceEngine
from astrai.model import Transformer, preset
from astrai.train.module import token_logprobs

MODES = {
    "contiguous": dict(cache_mode="contiguous"),
    "paged-16-radix": dict(cache_mode="paged", page_size=16, kv_tokens=4096),
}


@pytest.fixture(scope="module")
def mla_model(tokenizer) -> Transformer:
    cfg = preset("tiny-mla", vocab_size=len(tokenizer), initializer_range=0.15)
    torch.manual_seed(0)
    return Transformer(cfg).eval()


def prompts(n: int, seed: int = 0, vocab: int = 384) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(rng.randint(3, 60))] for _ in range(n)]


@pytest.mark.parametrize("mode", sorted(MODES))
def test_mla_greedy_equals_full_recomputation(mla_model, tokenizer, mode, greedy_reference):
    ps = prompts(8)
    ps += [ps[0] + [5, 6, 7, 8] * 5]  # shares a prefix with the first: the radix cache hits
    with InferenceEngine(
        mla_model, tokenizer, max_batch_size=8, max_seq_len=128, **MODES[mode]
    ) as eng:
        first = eng.run_batch(ps[:8], max_tokens=10, temperature=0.0, ignore_eos=True)
        second = eng.run_batch(ps[8:], max_tokens=10, temperature=0.0, ignore_eos=True)
        if mode.endswith("radix"):  # the second batch reused the first prompt's pages
            assert eng.pool.stats()["prefix_hit_rate"] > 0
    for p, out in zip(ps, first + second):
        assert out == greedy_reference(mla_model, p, 10)


def test_mla_cache_holds_latent_sized_entries(mla_model, tokenizer):
    cfg = mla_model.config
    with InferenceEngine(
        mla_model, tokenizer, start=False, cache_mode="paged", page_size=16, kv_tokens=1024
    ) as eng:
        pool = eng.pool
        width = cfg.kv_lora_rank + cfg.qk_rope_head_dim
        assert pool.bytes_per_token == cfg.num_hidden_layers * width * 4  # fp32
        assert tuple(pool.k_buffer.shape[2:]) == (1, width)
        assert pool.v_buffer.numel() == 0
        # Against the GQA layout of the same heads: K and V per head of qk_head_dim / v_head_dim.
        heads = cfg.num_attention_heads
        gqa = (
            cfg.num_hidden_layers
            * heads
            * (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim + cfg.v_head_dim)
            * 4
        )
        assert pool.bytes_per_token < gqa


def test_mla_logprobs_equal_training_forward(mla_model, tokenizer):
    """The engine (latent cache, absorbed decode) and the training forward (decompressed K/V,
    train mode, autograd on) give the same log-probs."""
    ps = prompts(4, seed=2)
    with InferenceEngine(mla_model, tokenizer, start=False, cache_mode="paged", page_size=4) as eng:
        out = eng.run_batch(
            ps, max_tokens=8, temperature=1.0, seed=7, return_logprobs=True, ignore_eos=True
        )
    mla_model.train()
    try:
        for p, (ids, lps) in zip(ps, out):
            assert len(ids) == len(lps) == 8
            logits = mla_model(torch.tensor([p + ids]))[0]
            ref = token_logprobs(logits[None, len(p) - 1 : -1], torch.tensor([ids]))[0]
            torch.testing.assert_close(torch.tensor(lps), ref.detach(), atol=1e-5, rtol=0)
    finally:
        mla_model.eval()


def test_mla_chunked_prefill_and_mixed_steps(mla_model, tokenizer, greedy_reference):
    ps = prompts(6, seed=1)
    with InferenceEngine(mla_model, tokenizer, max_batch_size=6, max_prefill_tokens=7) as eng:
        out = eng.run_batch(ps, max_tokens=6, temperature=0.0, ignore_eos=True)
    assert out == [greedy_reference(mla_model, p, 6) for p in ps]


def test_strict_non_torch_backend_is_refused_not_switched(mla_model, tokenizer):
    from astrai.extension import BackendUnavailable, attn_backend
    from astrai.extension.mla import latent_attention

    with attn_backend("triton"), pytest.raises(BackendUnavailable, match="torch_native"):
        latent_attention(
            torch.zeros(1, 4, 40), torch.zeros(1, 40), None, 0, scale=1.0, value_dim=32
        )


def test_mla_engine_with_lora_on_kv_b_proj(tokenizer, greedy_reference):
    """A LoRA adapter on kv_b_proj reaches the absorbed decode projections too."""
    from astrai.model.lora import LoRAConfig, inject_lora

    torch.manual_seed(1)
    model = Transformer(preset("tiny-mla", vocab_size=len(tokenizer), initializer_range=0.15))
    inject_lora(model, LoRAConfig(r=4, target_modules=["kv_b_proj", "o_proj"]))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.2)  # a non-zero update, so it changes the output
    model.eval()
    ps = prompts(3, seed=4)
    with InferenceEngine(model, tokenizer, max_batch_size=3, cache_mode="paged") as eng:
        out = eng.run_batch(ps, max_tokens=6, temperature=0.0, ignore_eos=True)
    assert out == [greedy_reference(model, p, 6) for p in ps]
