"""Which backend serves an attention call: explicit selection is strict, auto falls back.

Explicit selection comes from `with attn_backend(...)` (a context variable, so it is
per-thread / per-task and nestable, like `torch.nn.attention.sdpa_kernel`) or from the
`ASTR_BACKEND` environment variable, read at call time; the context wins over the env var.
An explicitly selected backend that cannot serve a call raises `BackendUnavailable`: a
benchmark or a bug report must never silently measure a different backend. Without an
explicit selection each call takes the first of triton, flash, cpu (the compiled CPU kernel,
when built), torch_native that supports it.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from enum import StrEnum

import torch

from astrai.extension.backend.base import AttentionBackend, BackendUnavailable
from astrai.extension.backend.cpu_paged import CpuPagedBackend
from astrai.extension.backend.flash import FlashAttnBackend
from astrai.extension.backend.sinks import sink_attention
from astrai.extension.backend.torch_native import TorchNativeBackend
from astrai.extension.backend.triton import TritonBackend
from astrai.extension.backend.windowed import windowed_attention
from astrai.extension.kv_cache import KVCache

logger = logging.getLogger(__name__)

ENV_VAR = "ASTR_BACKEND"


class ATTN_BACKEND(StrEnum):
    """Attention backends by name. `CUDA` is an alias of `TRITON` (kernels are Triton)."""

    TRITON = "triton"
    FLASH = "flash"
    TORCH_NATIVE = "torch_native"
    CPU = "cpu"
    CUDA = "triton"

    @classmethod
    def _missing_(cls, value: object) -> ATTN_BACKEND | None:
        if not isinstance(value, str):
            return None
        name = value.strip().lower()
        if name == "cuda":
            return cls.TRITON
        return next((m for m in cls if m.value == name), None)


_CHOICES = "triton, cuda (alias of triton), flash, cpu, torch_native"
AUTO_ORDER: tuple[ATTN_BACKEND, ...] = (
    ATTN_BACKEND.TRITON,
    ATTN_BACKEND.FLASH,
    ATTN_BACKEND.CPU,
    ATTN_BACKEND.TORCH_NATIVE,
)
_BACKENDS: dict[ATTN_BACKEND, AttentionBackend] = {
    ATTN_BACKEND.TRITON: TritonBackend(),
    ATTN_BACKEND.FLASH: FlashAttnBackend(),
    ATTN_BACKEND.CPU: CpuPagedBackend(),
    ATTN_BACKEND.TORCH_NATIVE: TorchNativeBackend(),
}
_selected: ContextVar[ATTN_BACKEND | None] = ContextVar("astrai_attn_backend", default=None)
_logged_skips: set[tuple[ATTN_BACKEND, str]] = set()


def parse_backend(name: str | ATTN_BACKEND) -> ATTN_BACKEND:
    """`ATTN_BACKEND` for a name (case-insensitive, "cuda" means triton); ValueError if unknown."""
    try:
        return ATTN_BACKEND(name)
    except ValueError:
        raise ValueError(f"unknown attention backend {name!r}; choose one of {_CHOICES}") from None


def get_backend(name: str | ATTN_BACKEND) -> AttentionBackend:
    """The (process-wide) backend instance for a name."""
    return _BACKENDS[parse_backend(name)]


@contextmanager
def attn_backend(backend: str | ATTN_BACKEND | None) -> Iterator[None]:
    """Strictly select `backend` for attention calls in this context (None: no selection here,
    so `ASTR_BACKEND` or auto-selection applies). Nestable; the previous selection is restored
    on exit. Context variables do not follow work handed to another thread: a scheduler thread
    should capture `selected_backend()` when a request arrives and re-enter it around forwards.
    """
    choice = None if backend is None else parse_backend(backend)
    token = _selected.set(choice)
    try:
        yield
    finally:
        _selected.reset(token)


def _env_backend() -> ATTN_BACKEND | None:
    raw = os.environ.get(ENV_VAR, "").strip()
    if not raw:
        return None
    try:
        return ATTN_BACKEND(raw)
    except ValueError:
        raise ValueError(
            f"{ENV_VAR}={raw!r} is not an attention backend; choose one of {_CHOICES}"
        ) from None


def _explicit() -> tuple[ATTN_BACKEND, str] | None:
    choice = _selected.get()
    if choice is not None:
        return choice, "attn_backend(...)"
    env = _env_backend()
    return None if env is None else (env, f"{ENV_VAR}={env.value}")


def selected_backend() -> ATTN_BACKEND | None:
    """The explicitly selected backend (context first, then `ASTR_BACKEND`), or None for auto."""
    explicit = _explicit()
    return None if explicit is None else explicit[0]


def resolve_backend(q: torch.Tensor, kv_cache: KVCache) -> AttentionBackend:
    """The backend that serves this call under the selection policy, or BackendUnavailable."""
    explicit = _explicit()
    if explicit is not None:
        choice, source = explicit
        backend = _BACKENDS[choice]
        reason = backend.supports(q, kv_cache)
        if reason is not None:
            raise BackendUnavailable(
                f"attention backend {choice.value!r} was selected by {source} "
                f"but cannot serve this call: {reason}"
            )
        return backend
    reasons = []
    for choice in AUTO_ORDER:
        backend = _BACKENDS[choice]
        reason = backend.auto_reason(q, kv_cache)
        if reason is None:
            return backend
        reasons.append(f"{choice.value}: {reason}")
        if (choice, reason) not in _logged_skips:  # once per reason: this runs every layer
            _logged_skips.add((choice, reason))
            logger.debug("auto attention backend selection skips %s: %s", choice.value, reason)
    raise BackendUnavailable("no attention backend can serve this call: " + "; ".join(reasons))


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: KVCache,
    layer_id: int,
    *,
    scale: float | None = None,
    window: int | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Write this step's K/V into the cache, then attend causally per request.

    q: `[num_tokens, n_heads, head_dim]`; k, v: `[num_tokens, n_kv_heads, head_dim]` (RoPE
    applied); returns `[num_tokens, n_heads, head_dim]`. `scale` defaults to head_dim**-0.5.
    `window`: a sliding-window layer's window; once a request's keys outgrow it, a backend
    whose kernels take it (`takes_window`: the compiled CPU kernel, triton, flash) gets it as
    an argument, and torch_native's calls go to `windowed_attention` (SDPA over the window's
    rows). `sinks` (`[n_heads]`, GPT-OSS): a backend whose kernels take them (`takes_sinks`:
    the compiled CPU kernel, triton) gets them (and the window) as arguments; otherwise the
    call goes to `sink_attention` (plain torch per request, with the window if any), and an
    explicit flash selection refuses it.
    """
    if scale is None:
        scale = q.shape[-1] ** -0.5
    backend = resolve_backend(q, kv_cache)
    if sinks is not None:
        if backend.takes_sinks:
            return backend.forward(q, k, v, kv_cache, layer_id, scale, window, sinks)
        explicit = _explicit()
        if explicit is not None and explicit[0] == ATTN_BACKEND.FLASH:
            raise BackendUnavailable(
                f"attention backend {explicit[0].value!r} was selected by {explicit[1]} but "
                "has no attention sinks; select torch_native, cpu or triton, or leave the "
                "choice to auto selection"
            )
        return sink_attention(q, k, v, kv_cache, layer_id, scale, window, sinks)
    if window is not None and kv_cache.max_len > window:
        if backend.takes_window:
            return backend.forward(q, k, v, kv_cache, layer_id, scale, window)
        return windowed_attention(q, k, v, kv_cache, layer_id, scale, window)
    return backend.forward(q, k, v, kv_cache, layer_id, scale)
