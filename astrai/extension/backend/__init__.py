"""Capability checks, backend selection and KV cache I/O for attention.

Use the policy entry point `astrai.extension.attention`; the backend classes are here for
tests and for code that must name one directly.
"""

from astrai.extension.backend.base import AttentionBackend, BackendUnavailable
from astrai.extension.backend.cpu_paged import CpuPagedBackend
from astrai.extension.backend.flash import FlashAttnBackend
from astrai.extension.backend.rotary import apply_rotary_emb, apply_rotary_qk
from astrai.extension.backend.selection import (
    ATTN_BACKEND,
    attention,
    attn_backend,
    get_backend,
    resolve_backend,
    selected_backend,
)
from astrai.extension.backend.torch_native import TorchNativeBackend
from astrai.extension.backend.triton import TritonBackend

__all__ = [
    "ATTN_BACKEND",
    "AttentionBackend",
    "BackendUnavailable",
    "CpuPagedBackend",
    "FlashAttnBackend",
    "TorchNativeBackend",
    "TritonBackend",
    "apply_rotary_emb",
    "apply_rotary_qk",
    "attention",
    "attn_backend",
    "get_backend",
    "resolve_backend",
    "selected_backend",
]
