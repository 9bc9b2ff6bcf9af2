"""Sliding-window models in the engine: greedy output equals transformers' own greedy
`generate` for prompts longer than the window and generation past it (paged cache, radix
prefix cache, page size smaller than the window), per backend (triton through its
interpreter); and the windowed attention reads only the window's rows."""

import random

import pytest
import torch
import transformers

from astrai.extension import KVCache
from astrai.extension.backend.windowed import windowed_attention
from astrai.extension.cpu_kernels import paged_attention_op
from astrai.inference import InferenceEngine
from astrai.model import AutoModel

WINDOW = 6
BASE = dict(
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
    initializer_range=0.2,  # spread-out logits: greedy has no near-ties
)
FAMILIES = {
    "mistral": (transformers.MistralConfig, dict(sliding_window=WINDOW, head_dim=16)),
    "qwen2": (
        transformers.Qwen2Config,
        dict(use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1),
    ),
    "mixtral": (  # a MoE family: its window covers every layer
        transformers.MixtralConfig,
        dict(sliding_window=WINDOW, head_dim=16, num_local_experts=4, num_experts_per_tok=2),
    ),
    # per-layer-type RoPE (the sliding layers' own base) and sandwich blocks
    "gemma3": (
        transformers.Gemma3TextConfig,
        dict(
            sliding_window=WINDOW,
            layer_types=["sliding_attention", "full_attention"],
            head_dim=16,
            query_pre_attn_scalar=24,
            rope_theta=20000.0,
            rope_local_base_freq=500.0,
        ),
    ),
}
NO_KERNEL = pytest.mark.skipif(
    paged_attention_op() is None, reason="the CPU kernel is not built (make setup)"
)
# (family, backend): every family on both CPU backends, and Qwen2 (full and windowed layers)
# on triton, interpreted on the CPU (TRITON_INTERPRET=1, tests/conftest.py)
CASES = [
    *[pytest.param(f, "torch_native", id=f"{f}-torch_native") for f in sorted(FAMILIES)],
    *[pytest.param(f, "cpu", marks=NO_KERNEL, id=f"{f}-cpu") for f in sorted(FAMILIES)],
    pytest.param("qwen2", "triton", marks=pytest.mark.slow, id="qwen2-triton"),
]


def build_hf(family: str, vocab: int):
    config_cls, extra = FAMILIES[family]
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(
        config_cls(vocab_size=vocab, **BASE, **extra)
    ).eval()


def hf_greedy(hf, prompt: list[int], n: int) -> list[int]:
    with torch.no_grad():
        out = hf.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=n,
            min_new_tokens=n,
            do_sample=False,
            pad_token_id=0,
        )
    return out[0, len(prompt) :].tolist()


def paged_engine(model, tokenizer, max_batch_size: int) -> InferenceEngine:
    """Pages of 4 (smaller than the window) with the radix prefix cache."""
    return InferenceEngine(
        model,
        tokenizer,
        cache_mode="paged",
        page_size=4,
        prefix_cache=True,
        max_batch_size=max_batch_size,
        max_seq_len=64,
        start=False,
    )


@pytest.mark.parametrize(("family", "backend"), CASES)
def test_engine_greedy_equals_transformers_past_the_window(
    family, backend, stdlib_tokenizer, tmp_path, monkeypatch
):
    tokenizer = stdlib_tokenizer
    hf = build_hf(family, len(tokenizer))
    hf.save_pretrained(tmp_path)
    ours = AutoModel.from_pretrained(tmp_path).eval()
    assert ours.config.sliding_window == WINDOW
    rng = random.Random(3)
    shared = [rng.randrange(300) for _ in range(13)]
    first = [shared + [rng.randrange(300) for _ in range(rng.randint(1, 9))] for _ in range(2)]
    second = [shared + [rng.randrange(300) for _ in range(rng.randint(1, 9))] for _ in range(3)]
    monkeypatch.setenv("ASTR_BACKEND", backend)
    kw = dict(max_tokens=10, temperature=0.0, ignore_eos=True)
    with paged_engine(ours, tokenizer, max_batch_size=4) as eng:
        out = eng.run_batch(first, **kw)
        out += eng.run_batch(second, **kw)
        assert eng.get_stats()["cached_prompt_tokens"] >= 12 * len(second)  # prefix reused
    for prompt, ids in zip(first + second, out):
        assert ids == hf_greedy(hf, prompt, 10)


def test_windowed_attention_reads_only_the_window(monkeypatch):
    """Slots outside the window hold NaN: the result stays finite and equals attention over
    the window alone."""
    torch.manual_seed(0)
    kv_len, q_len, heads, dim = 20, 3, 2, 8
    k_buf = torch.full((1, 64, heads, dim), float("nan"))
    v_buf = torch.full((1, 64, heads, dim), float("nan"))
    slots = torch.randperm(64)[:kv_len]
    keys, values = torch.randn(kv_len, heads, dim), torch.randn(kv_len, heads, dim)
    first = kv_len - q_len - WINDOW + 1
    k_buf[0, slots[first : kv_len - q_len]] = keys[first : kv_len - q_len]
    v_buf[0, slots[first : kv_len - q_len]] = values[first : kv_len - q_len]
    cache = KVCache(
        k_buffer=k_buf,
        v_buffer=v_buf,
        req_to_token=slots[None].to(torch.int32),
        req_pool_indices=torch.tensor([0]),
        seq_lens=torch.tensor([kv_len], dtype=torch.int32),
        out_cache_loc=slots[kv_len - q_len :],
        kv_indptr=torch.tensor([0, kv_len], dtype=torch.int32),
        qo_indptr=torch.tensor([0, q_len], dtype=torch.int32),
        max_len=kv_len,
        max_q_len=q_len,
        seq_lens_host=(kv_len,),
        q_lens_host=(q_len,),
    )
    q = torch.randn(q_len, heads, dim)
    new_k, new_v = keys[kv_len - q_len :], values[kv_len - q_len :]
    out = windowed_attention(q, new_k, new_v, cache, 0, dim**-0.5, WINDOW)
    for j in range(q_len):
        pos = kv_len - q_len + j
        seen = slice(pos - WINDOW + 1, pos + 1)
        scores = torch.einsum("hd,khd->hk", q[j], keys[seen]) * dim**-0.5
        expected = torch.einsum("hk,khd->hd", scores.softmax(-1), values[seen])
        torch.testing.assert_close(out[j], expected)


@pytest.mark.parametrize("family", ["mistral", "gemma3"])
def test_decoding_gives_back_the_pages_behind_the_window(family, stdlib_tokenizer, tmp_path):
    """Every layer windowed (Mistral): as a request decodes, its row keeps only the pages
    its window still reads (KV in use stays near the window, not the sequence); greedy output
    equals transformers' and the prompt's pages, cached when its prefill completed, serve a
    second request. A model with a global layer (Gemma 3) keeps every page."""
    tokenizer = stdlib_tokenizer
    hf = build_hf(family, len(tokenizer))
    hf.save_pretrained(tmp_path)
    ours = AutoModel.from_pretrained(tmp_path).eval()
    rng = random.Random(5)
    prompt = [rng.randrange(300) for _ in range(30)]
    seen: list[int] = []
    with paged_engine(ours, tokenizer, max_batch_size=2) as eng:

        def spy(ids: list[int], logits: torch.Tensor) -> torch.Tensor:
            seen.append(eng.pool.used_tokens)  # the row's KV at each sampled token
            return logits

        kw = dict(max_tokens=20, temperature=0.0, ignore_eos=True)
        (first,) = eng.run_batch([prompt], logits_processors=(spy,), **kw)
        (again,) = eng.run_batch([prompt], **kw)
        assert eng.get_stats()["cached_prompt_tokens"] >= 28  # the prompt's 7 whole pages
        assert eng.pool.all_free()
    assert first == again == hf_greedy(hf, prompt, 20)
    assert seen[0] >= 32  # after the prefill: the whole prompt
    if family == "mistral":  # the window (6) rounded out to pages, plus the page being filled
        assert max(seen[3:]) <= 12, seen
    else:
        assert seen[-1] >= 48, seen
