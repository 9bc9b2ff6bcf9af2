"""Backend selection policy: auto falls back per call; explicit selection is strict."""

from __future__ import annotations

import threading

import pytest
import torch
from kv_cases import LAYER, make_case

import astrai.extension.backend.selection as selection
from astrai.extension import (
    ATTN_BACKEND,
    BackendUnavailable,
    attention,
    attn_backend,
    get_backend,
    selected_backend,
)
from astrai.extension.backend import resolve_backend
from astrai.extension.cpu_kernels import paged_attention_op

# fp32 on the CPU: the compiled kernel when `make setup` built it, else SDPA
CPU_AUTO = "cpu" if paged_attention_op() is not None else "torch_native"


@pytest.fixture(autouse=True)
def no_env(monkeypatch):
    monkeypatch.delenv("ASTR_BACKEND", raising=False)
    # Without the interpreter, CPU tensors are something triton cannot serve.
    monkeypatch.setenv("TRITON_INTERPRET", "0")


@pytest.fixture
def case():
    return make_case([(2, 3), (0, 1)], n_heads=4, n_kv_heads=2, head_dim=16)


def test_auto_picks_the_cpu_kernel_or_torch_native_on_cpu(case):
    assert selected_backend() is None
    assert resolve_backend(case.q, case.cache).name == CPU_AUTO
    out = attention(case.q, case.k, case.v, case.cache, LAYER, scale=0.25)
    assert out.shape == case.q.shape


def test_auto_order_is_triton_flash_cpu_torch_native():
    assert [b.value for b in selection.AUTO_ORDER] == ["triton", "flash", "cpu", "torch_native"]


def test_auto_takes_first_capable_backend(case, monkeypatch):
    """Were triton able to serve, auto must take it over torch_native."""
    triton = get_backend("triton")
    monkeypatch.setattr(type(triton), "auto_reason", lambda self, q, kv: None)
    assert resolve_backend(case.q, case.cache) is triton


def test_auto_never_picks_the_triton_interpreter_on_cpu(case, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    triton = get_backend("triton")
    assert triton.supports(case.q, case.cache) is None  # servable when chosen explicitly
    assert resolve_backend(case.q, case.cache).name == CPU_AUTO


def test_names_and_cuda_alias():
    assert ATTN_BACKEND("cuda") is ATTN_BACKEND.TRITON
    assert ATTN_BACKEND.CUDA is ATTN_BACKEND.TRITON
    assert ATTN_BACKEND("Torch_Native") is ATTN_BACKEND.TORCH_NATIVE
    assert get_backend(ATTN_BACKEND.FLASH).name == "flash"
    with pytest.raises(ValueError, match="unknown attention backend 'nope'"):
        get_backend("nope")
    with pytest.raises(ValueError, match="unknown attention backend"), attn_backend("nope"):
        pass


@pytest.mark.parametrize("name", ["triton", "cuda", ATTN_BACKEND.TRITON])
def test_explicit_triton_context_is_strict(case, name):
    before = case.cache.k_buffer.clone()
    with (
        attn_backend(name),
        pytest.raises(BackendUnavailable, match=r"'triton'.*(CUDA|TRITON_INTERPRET)"),
    ):
        attention(case.q, case.k, case.v, case.cache, LAYER, scale=0.25)
    # Refused before anything was written.
    assert torch.equal(case.cache.k_buffer, before)


@pytest.mark.parametrize("value", ["triton", "cuda", "flash"])
def test_explicit_env_is_strict(case, monkeypatch, value):
    monkeypatch.setenv("ASTR_BACKEND", value)
    with pytest.raises(BackendUnavailable, match="ASTR_BACKEND"):
        attention(case.q, case.k, case.v, case.cache, LAYER, scale=0.25)


def test_env_torch_native_serves(case, monkeypatch):
    monkeypatch.setenv("ASTR_BACKEND", "torch_native")
    assert selected_backend() is ATTN_BACKEND.TORCH_NATIVE
    attention(case.q, case.k, case.v, case.cache, LAYER, scale=0.25)


def test_invalid_env_names_the_variable(case, monkeypatch):
    monkeypatch.setenv("ASTR_BACKEND", "bogus")
    with pytest.raises(ValueError, match=r"ASTR_BACKEND='bogus'.*torch_native"):
        attention(case.q, case.k, case.v, case.cache, LAYER, scale=0.25)


def test_env_is_read_at_call_time(case, monkeypatch):
    attention(case.q, case.k, case.v, case.cache, LAYER, scale=0.25)
    monkeypatch.setenv("ASTR_BACKEND", "triton")
    with pytest.raises(BackendUnavailable):
        attention(case.q, case.k, case.v, case.cache, LAYER, scale=0.25)


def test_context_beats_env(case, monkeypatch):
    monkeypatch.setenv("ASTR_BACKEND", "triton")
    with attn_backend("torch_native"):
        assert selected_backend() is ATTN_BACKEND.TORCH_NATIVE
        attention(case.q, case.k, case.v, case.cache, LAYER, scale=0.25)
    monkeypatch.setenv("ASTR_BACKEND", "torch_native")
    with attn_backend("triton"), pytest.raises(BackendUnavailable, match=r"attn_backend"):
        attention(case.q, case.k, case.v, case.cache, LAYER, scale=0.25)


def test_nesting_restores(monkeypatch):
    monkeypatch.setenv("ASTR_BACKEND", "flash")
    assert selected_backend() is ATTN_BACKEND.FLASH
    with attn_backend("torch_native"):
        with attn_backend("triton"):
            assert selected_backend() is ATTN_BACKEND.TRITON
            with attn_backend(None):  # no selection at this level: the env var applies
                assert selected_backend() is ATTN_BACKEND.FLASH
            assert selected_backend() is ATTN_BACKEND.TRITON
        assert selected_backend() is ATTN_BACKEND.TORCH_NATIVE
        with pytest.raises(RuntimeError), attn_backend("triton"):
            raise RuntimeError("boom")
        assert selected_backend() is ATTN_BACKEND.TORCH_NATIVE
    assert selected_backend() is ATTN_BACKEND.FLASH


def test_selection_is_per_thread():
    seen = []
    with attn_backend("triton"):
        worker = threading.Thread(target=lambda: seen.append(selected_backend()))
        worker.start()
        worker.join()
    assert seen == [None]


def test_no_capable_backend_lists_every_reason(case):
    q = case.q.to(torch.int32)
    with pytest.raises(BackendUnavailable, match=r"triton: .*flash: .*cpu: .*torch_native: "):
        resolve_backend(q, case.cache)


def test_flash_unavailable_here_says_why(case):
    reason = get_backend("flash").supports(case.q, case.cache)
    assert reason is not None and ("flash_attn" in reason or "CUDA" in reason)
