"""FlashAttnBackend against torch_native on CUDA (needs a GPU and flash-attn)."""

from __future__ import annotations

import pytest
import torch
from kv_cases import LAYER, make_case, reference

from astrai.extension.backend import FlashAttnBackend, TorchNativeBackend


@pytest.mark.gpu
@pytest.mark.parametrize("reqs", [[(0, 7), (5, 3), (9, 1)], [(6, 1), (0, 1)]])
def test_flash_matches_torch_native(reqs):
    pytest.importorskip("flash_attn")
    case = make_case(reqs, n_heads=8, n_kv_heads=2, head_dim=64, dtype=torch.bfloat16)
    cache = case.cache
    tensors = ("k_buffer", "v_buffer", "req_to_token", "req_pool_indices", "seq_lens")
    for name in (*tensors, "out_cache_loc", "kv_indptr", "qo_indptr"):
        setattr(cache, name, getattr(cache, name).cuda())
    q, k, v = case.q.cuda(), case.k.cuda(), case.v.cuda()
    flash = FlashAttnBackend()
    assert flash.supports(q, cache) is None
    out = flash.forward(q, k, v, cache, LAYER, 0.125)
    ref = TorchNativeBackend().forward(q, k, v, cache, LAYER, 0.125)
    torch.testing.assert_close(out, ref, atol=2e-2, rtol=2e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("window", [1, 4])
def test_flash_sliding_window_matches_reference(window):
    """flash-attn's `window_size` against the dense float64 reference's sliding window."""
    pytest.importorskip("flash_attn")
    reqs = [(0, 7), (5, 3), (9, 1), (20, 2)]
    case = make_case(reqs, n_heads=8, n_kv_heads=2, head_dim=64, dtype=torch.bfloat16)
    k_before, v_before = case.cache.k_buffer.clone(), case.cache.v_buffer.clone()
    expected = reference(case, k_before, v_before, 0.125, window)
    cache = case.cache
    tensors = ("k_buffer", "v_buffer", "req_to_token", "req_pool_indices", "seq_lens")
    for name in (*tensors, "out_cache_loc", "kv_indptr", "qo_indptr"):
        setattr(cache, name, getattr(cache, name).cuda())
    q, k, v = case.q.cuda(), case.k.cuda(), case.v.cuda()
    out = FlashAttnBackend().forward(q, k, v, cache, LAYER, 0.125, window)
    torch.testing.assert_close(out.double().cpu(), expected, atol=2e-2, rtol=2e-2)
