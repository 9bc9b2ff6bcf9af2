"""`kv_cache_dtype`: the int8 KV cache through the engine, and what it refuses."""

from __future__ import annotations

import pytest
import torch

from astrai.extension.cpu_kernels import ENV_VAR, paged_attention_op
from astrai.inference import InferenceEngine
from astrai.inference.cache import PagePool
from astrai.inference.cache.kv_dtype import check_kv_cache_dtype
from astrai.inference.engine_options import check_engine_blocks

needs_kernel = pytest.mark.skipif(
    paged_attention_op() is None, reason="the CPU kernel is not built (make setup builds it)"
)
PROMPTS = [[5 + 7 * i + j for j in range(3 + 5 * i)] for i in range(6)]


def _greedy(engine: InferenceEngine, n: int) -> list[list[int]]:
    results = [engine.submit(p, max_tokens=n, temperature=0.0, ignore_eos=True) for p in PROMPTS]
    for r in results:
        r.wait_completion()
    return [r.token_ids for r in results]


@needs_kernel
@pytest.mark.parametrize("cache_mode", ["contiguous", "paged"])
def test_int8_cache_keeps_greedy_close_to_fp32(model, tokenizer, cache_mode):
    """The int8 engine against the fp32 one on the same model: the pool holds int8 with a
    scale per (layer, slot, KV head), and greedy tokens mostly agree (the agreement is
    measured, not assumed: a lost scale or a misread slot drops it to chance)."""
    kw = {"max_batch_size": 4, "max_seq_len": 96, "cache_mode": cache_mode}
    with InferenceEngine(model, tokenizer, **kw) as fp32:
        ref = _greedy(fp32, 24)
    with InferenceEngine(model, tokenizer, kv_cache_dtype="int8", **kw) as int8:
        assert int8.pool.k_buffer.dtype == torch.int8
        assert int8.pool.storage.k_scale is not None
        got = _greedy(int8, 24)
    same = sum(a == b for r, g in zip(ref, got) for a, b in zip(r, g))
    total = sum(len(r) for r in ref)
    # a random tiny model's logits are close together, so one flipped token changes the rest
    # of its sequence: 124 of 144 agree here (86%); a misread cache agrees at chance (1/vocab)
    assert same / total >= 0.75, f"int8 KV greedy agreement {same}/{total}"
    assert all(r[:2] == g[:2] for r, g in zip(ref, got))


def test_int8_pool_bytes_per_token():
    fp32 = PagePool(num_layers=2, num_kv_heads=2, head_dim=16, max_batch_size=2, max_seq_len=8)
    int8 = PagePool(
        num_layers=2,
        num_kv_heads=2,
        head_dim=16,
        dtype=torch.int8,
        max_batch_size=2,
        max_seq_len=8,
    )
    assert fp32.bytes_per_token == 2 * 2 * 32 * 4
    assert int8.bytes_per_token == 2 * 2 * (32 + 8)  # one byte each, plus two fp32 scales
    assert int8.storage.k_scale.shape == (2, 2 * 8 + 1, 2)
    assert int8.storage.allocated_bytes == sum(
        b.untyped_storage().nbytes() for b in int8.storage.buffers
    )
    int8.release()
    assert int8.storage.allocated_bytes == 0
    int8.resume()
    assert int8.storage.k_scale.abs().sum() == 0


@pytest.mark.parametrize("value", ["fp4", 8, "bfloat16"])
def test_a_bad_value_names_the_key(value, model, tokenizer):
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        check_kv_cache_dtype(value)
    with pytest.raises(SystemExit, match=r"engine\.kv_cache_dtype"):
        check_engine_blocks({"kv_cache_dtype": value})
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        InferenceEngine(model, tokenizer, kv_cache_dtype=value, start=False)


def test_auto_and_null_keep_the_model_dtype(model, tokenizer):
    assert check_kv_cache_dtype(None) == check_kv_cache_dtype("AUTO") == "auto"
    with InferenceEngine(model, tokenizer, max_seq_len=32, start=False) as eng:
        assert eng.pool.k_buffer.dtype == torch.float32
        assert eng.pool.storage.k_scale is None


def test_int8_refused_without_the_kernel(model, tokenizer, monkeypatch):
    monkeypatch.setenv(ENV_VAR, "0")
    with pytest.raises(ValueError, match="kv_cache_dtype='int8' cannot be used: the CPU"):
        InferenceEngine(model, tokenizer, kv_cache_dtype="int8", start=False)


def test_int8_refused_for_a_non_fp32_model(tokenizer):
    from tiny_parts import tiny_transformer

    half = tiny_transformer(len(tokenizer)).to(torch.bfloat16)
    with pytest.raises(ValueError, match="needs an fp32 model"):
        InferenceEngine(half, tokenizer, kv_cache_dtype="int8", start=False)


def test_int8_refused_with_batch_invariance(model, tokenizer):
    """Invariant attention is torch_native's per request, which reads no int8 cache: refused
    by the engine and by the config check, naming both keys."""
    with pytest.raises(ValueError, match="batch_invariant=true cannot be combined with kv_cache"):
        InferenceEngine(model, tokenizer, kv_cache_dtype="int8", batch_invariant=True, start=False)
    with pytest.raises(SystemExit, match=r"engine\.batch_invariant=true .* engine\.kv_cache"):
        check_engine_blocks({"batch_invariant": True, "kv_cache_dtype": "int8"})
    with pytest.raises(ValueError, match="cannot be combined with kv_cache_dtype=int8"):
        InferenceEngine(  # spelled as the pool accepts it
            model, tokenizer, kv_cache_dtype=" INT8", batch_invariant=True, start=False
        )
    check_engine_blocks({"batch_invariant": True, "kv_cache_dtype": "auto"})  # accepted
