"""The compiled CPU attention kernel against the independent dense reference (kv_cases) and
against torch_native, and its fallback when the kernel is absent or turned off."""

from __future__ import annotations

import pytest
import torch
from kv_cases import LAYER, make_case, reference

from astrai.extension import attention, attn_backend
from astrai.extension.backend import CpuPagedBackend, TorchNativeBackend, resolve_backend
from astrai.extension.backend.cpu_paged import EXTEND_MAX_Q, FRESH_MAX_Q
from astrai.extension.cpu_kernels import ENV_VAR, paged_attention_op

MIXED = [(0, 7), (5, 3), (0, 1), (9, 1), (2, 6)]  # (cached prefix, new tokens)
DECODE = [(6, 1), (0, 1), (13, 1), (3, 1), (40, 1)]
SPECULATIVE = [(6, 1), (5, 4), (13, 1), (0, 1), (3, 1), (9, 3)]
# chunks past the kernel's limits beside short rows: SDPA serves them, the kernel the rest
LONG = [(0, FRESH_MAX_Q + 5), (7, 1), (3, EXTEND_MAX_Q + 1), (11, 2), (0, FRESH_MAX_Q)]

needs_kernel = pytest.mark.skipif(
    paged_attention_op() is None, reason="the CPU kernel is not built (make setup builds it)"
)


def run(case, scale, backend, window=None):
    k_before, v_before = case.cache.k_buffer.clone(), case.cache.v_buffer.clone()
    extra = () if window is None else (window,)
    out = backend.forward(case.q, case.k, case.v, case.cache, LAYER, scale, *extra)
    return out, reference(case, k_before, v_before, scale, window)


@needs_kernel
@pytest.mark.parametrize("layout", ["paged", "contiguous", "head_major"])
@pytest.mark.parametrize("group", [1, 3, 4])
@pytest.mark.parametrize("head_dim", [16, 64, 128])
@pytest.mark.parametrize(
    "reqs", [MIXED, DECODE, SPECULATIVE, LONG], ids=["mixed", "decode", "spec", "long"]
)
def test_matches_reference(layout, group, head_dim, reqs):
    case = make_case(
        reqs,
        n_heads=2 * group,
        n_kv_heads=2,
        head_dim=head_dim,
        seed=group + head_dim,
        contiguous=layout == "contiguous",
        head_major=layout == "head_major",
    )
    out, ref = run(case, head_dim**-0.5, CpuPagedBackend())
    assert out.shape == case.q.shape and out.dtype == torch.float32
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)


@needs_kernel
@pytest.mark.parametrize("layout", ["paged", "contiguous", "head_major"])
@pytest.mark.parametrize("head_dim", [16, 64, 128])
@pytest.mark.parametrize("window", [1, 3, 8])
@pytest.mark.parametrize(
    "reqs", [MIXED, DECODE, SPECULATIVE, LONG], ids=["mixed", "decode", "spec", "long"]
)
def test_sliding_window_matches_reference(layout, head_dim, window, reqs):
    """A windowed layer: each query sees only its window's keys (the long chunks go to SDPA
    over the window's rows), GQA groups of 3."""
    case = make_case(
        reqs,
        n_heads=6,
        n_kv_heads=2,
        head_dim=head_dim,
        seed=window + head_dim,
        contiguous=layout == "contiguous",
        head_major=layout == "head_major",
    )
    out, ref = run(case, head_dim**-0.5, CpuPagedBackend(), window)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)


@needs_kernel
@pytest.mark.parametrize("layout", ["paged", "contiguous"])
@pytest.mark.parametrize("window", [None, 3])
@pytest.mark.parametrize(
    "reqs", [MIXED, DECODE, SPECULATIVE, LONG], ids=["mixed", "decode", "spec", "long"]
)
def test_attention_sinks_match_reference(layout, window, reqs):
    """GPT-OSS's sinks (one logit per query head in each softmax's denominator), with and
    without a window; the long chunks take `sinks.sink_span`."""
    case = make_case(
        reqs, n_heads=6, n_kv_heads=2, head_dim=64, seed=17, contiguous=layout == "contiguous"
    )
    sinks = torch.randn(6, generator=torch.Generator().manual_seed(3)) * 2
    k_before, v_before = case.cache.k_buffer.clone(), case.cache.v_buffer.clone()
    out = CpuPagedBackend().forward(case.q, case.k, case.v, case.cache, LAYER, 0.125, window, sinks)
    ref = reference(case, k_before, v_before, 0.125, window, sinks)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(ref, reference(case, k_before, v_before, 0.125, window))


@needs_kernel
@pytest.mark.parametrize("reqs", [MIXED, DECODE], ids=["mixed", "decode"])
def test_agrees_with_torch_native(reqs):
    """Both backends on the same cache: the outputs and the written cache agree."""
    a = make_case(reqs, n_heads=8, n_kv_heads=2, head_dim=64, seed=11, head_major=True)
    b = make_case(reqs, n_heads=8, n_kv_heads=2, head_dim=64, seed=11, head_major=True)
    out_kernel = CpuPagedBackend().forward(a.q, a.k, a.v, a.cache, LAYER, 0.125)
    out_torch = TorchNativeBackend().forward(b.q, b.k, b.v, b.cache, LAYER, 0.125)
    torch.testing.assert_close(out_kernel, out_torch, atol=2e-6, rtol=2e-6)
    assert torch.equal(a.cache.k_buffer, b.cache.k_buffer)
    assert torch.equal(a.cache.v_buffer, b.cache.v_buffer)


@needs_kernel
def test_auto_selection_picks_the_kernel_on_cpu_fp32():
    case = make_case(DECODE, n_heads=4, n_kv_heads=2, head_dim=16)
    assert isinstance(resolve_backend(case.q, case.cache), CpuPagedBackend)
    half = make_case(DECODE, n_heads=4, n_kv_heads=2, head_dim=16, dtype=torch.bfloat16)
    assert isinstance(resolve_backend(half.q, half.cache), TorchNativeBackend)


def test_turned_off_falls_back_to_torch_native(monkeypatch):
    """ASTR_CPU_KERNELS=0 (or no build): auto selection serves the call with torch_native,
    with the same result; an explicit `cpu` selection refuses, naming why."""
    monkeypatch.setenv(ENV_VAR, "0")
    assert paged_attention_op() is None
    case = make_case(MIXED, n_heads=4, n_kv_heads=2, head_dim=16, seed=2)
    assert isinstance(resolve_backend(case.q, case.cache), TorchNativeBackend)
    k_before, v_before = case.cache.k_buffer.clone(), case.cache.v_buffer.clone()
    out = attention(case.q, case.k, case.v, case.cache, LAYER, scale=0.25)
    ref = reference(case, k_before, v_before, 0.25)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)
    reason = CpuPagedBackend().supports(case.q, case.cache)
    assert reason is not None and ENV_VAR in reason
    with attn_backend("cpu"), pytest.raises(RuntimeError, match="'cpu' was selected"):
        attention(case.q, case.k, case.v, case.cache, LAYER)


def test_missing_library_falls_back(monkeypatch, tmp_path):
    """A checkout where `make setup` could not build the kernel: not loaded, no error."""
    from astrai.extension import cpu_kernels

    monkeypatch.setattr(cpu_kernels, "BUILD_DIR", tmp_path)
    cpu_kernels.reset()
    try:
        assert cpu_kernels.paged_attention_op() is None
        case = make_case(DECODE, n_heads=4, n_kv_heads=2, head_dim=16)
        assert isinstance(resolve_backend(case.q, case.cache), TorchNativeBackend)
    finally:
        cpu_kernels.reset()


def _int8_case(reqs, layout: str, seed: int):
    """A case whose cache is int8 with per-(slot, head) scales; its new k/v are rounded to
    what the int8 cache will hold, so the reference sees exactly the values the kernel reads."""
    import dataclasses

    from astrai.extension.backend.base import quantize_int8

    case = make_case(
        reqs, n_heads=8, n_kv_heads=2, head_dim=64, seed=seed, contiguous=layout == "contiguous"
    )
    kq, ks = quantize_int8(case.cache.k_buffer.flatten(0, 1))
    vq, vs = quantize_int8(case.cache.v_buffer.flatten(0, 1))
    shape = case.cache.k_buffer.shape
    cache = dataclasses.replace(
        case.cache,
        k_buffer=kq.view(shape),
        v_buffer=vq.view(shape),
        k_scale=ks.view(shape[:-1]),
        v_scale=vs.view(shape[:-1]),
    )
    k_new, k_scale = quantize_int8(case.k)
    v_new, v_scale = quantize_int8(case.v)
    k = k_new.float() * k_scale[..., None]
    v = v_new.float() * v_scale[..., None]
    deq_k = kq.float().view(shape) * ks.view(shape[:-1])[..., None]
    deq_v = vq.float().view(shape) * vs.view(shape[:-1])[..., None]
    return dataclasses.replace(case, cache=cache, k=k, v=v), deq_k, deq_v


@needs_kernel
@pytest.mark.parametrize("layout", ["paged", "contiguous"])
@pytest.mark.parametrize("reqs", [MIXED, DECODE, LONG], ids=["mixed", "decode", "long"])
def test_int8_cache_matches_reference_on_dequantized_values(layout, reqs):
    """An int8 cache: the output is attention over the dequantized K/V (the long chunk's
    too), and the step's K/V land quantized with their scales."""
    case, deq_k, deq_v = _int8_case(reqs, layout, seed=7)
    # torch_native alone refuses an int8 cache; the kernel's backend still hands long
    # chunks to SDPA, over the dequantized prefix
    assert TorchNativeBackend().supports(case.q, case.cache) is not None
    out = CpuPagedBackend().forward(case.q, case.k, case.v, case.cache, LAYER, 0.125)
    ref = reference(case, deq_k, deq_v, 0.125)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)
    loc = case.cache.out_cache_loc
    stored = case.cache.k_buffer[LAYER, loc].float() * case.cache.k_scale[LAYER, loc][..., None]
    torch.testing.assert_close(stored, case.k, atol=1e-6, rtol=1e-6)


@needs_kernel
@pytest.mark.parametrize("reqs", [MIXED, DECODE, LONG], ids=["mixed", "decode", "long"])
def test_int8_cache_with_a_sliding_window(reqs):
    case, deq_k, deq_v = _int8_case(reqs, "paged", seed=5)
    out = CpuPagedBackend().forward(case.q, case.k, case.v, case.cache, LAYER, 0.125, 4)
    ref = reference(case, deq_k, deq_v, 0.125, window=4)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)
