"""The contract every attention backend implements, and the error raised when one cannot serve.

A backend owns both halves of a step's attention: writing the new tokens' K/V into the
cache and attending over each request's cached keys. Capability checks (`supports`) are
separate from the work (`forward`) so that the policy in `selection` can decide per call,
without trying and catching.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from astrai.extension.kv_cache import KVCache


class BackendUnavailable(RuntimeError):
    """A backend cannot serve this call (missing kernels or package, wrong device/dtype/shape)."""


class AttentionBackend(ABC):
    """Packed-token attention over a paged KV cache.

    Shapes: `q` is `[num_tokens, n_heads, head_dim]`, `k`/`v` are
    `[num_tokens, n_kv_heads, head_dim]` for this step's new tokens (RoPE already applied),
    and the result is `[num_tokens, n_heads, head_dim]`.
    """

    name: str
    # True: `forward` takes a sliding-window layer's `window` (its kernels read only each
    # query's window); False: `selection.attention` sends windowed calls to `windowed.py`.
    takes_window: bool = False
    # True: `forward` also takes attention `sinks` (`[n_heads]`, GPT-OSS) and applies them with
    # or without a window; False: `selection.attention` sends sink layers to `sinks.py`.
    takes_sinks: bool = False

    @abstractmethod
    def supports(self, q: torch.Tensor, kv_cache: KVCache) -> str | None:
        """None if this backend can serve the call, else a short human-readable reason.

        Called once per layer per step, so it must be cheap and must not sync the device.
        """

    def auto_reason(self, q: torch.Tensor, kv_cache: KVCache) -> str | None:
        """Like `supports`, for automatic selection, which may be stricter than an explicit
        choice (e.g. an interpreter path that is correct but far too slow to pick by default)."""
        return self.supports(q, kv_cache)

    @abstractmethod
    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: KVCache,
        layer_id: int,
        scale: float,
    ) -> torch.Tensor:
        """Write `k`/`v` at `kv_cache.out_cache_loc` of layer `layer_id`, then attend causally."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r})"


def shape_mismatch(q: torch.Tensor, kv_cache: KVCache) -> str | None:
    """Why a `[num_tokens, n_heads, head_dim]` query cannot attend over this cache's
    `[..., n_kv_heads, head_dim]` keys (None: it can); the CPU backends' common check."""
    if q.dim() != 3:
        return f"query must be [num_tokens, n_heads, head_dim], got shape {tuple(q.shape)}"
    n_kv_heads, head_dim = kv_cache.k_buffer.shape[-2:]
    if q.shape[1] % n_kv_heads or q.shape[2] != head_dim:
        return (
            f"query heads/head_dim {tuple(q.shape[1:])} do not fit a cache of "
            f"{n_kv_heads} kv heads x {head_dim}"
        )
    return None


def write_kv(k: torch.Tensor, v: torch.Tensor, kv_cache: KVCache, layer_id: int) -> None:
    """Store this step's K/V at their slots; shared by the backends that gather afterwards.
    An int8 cache stores each token's K/V per KV head as int8 with its absmax / 127 scale."""
    loc = kv_cache.out_cache_loc
    k_buf, v_buf = kv_cache.k_buffer[layer_id], kv_cache.v_buffer[layer_id]
    if kv_cache.k_scale is not None and kv_cache.v_scale is not None:
        for x, buf, scales in ((k, k_buf, kv_cache.k_scale), (v, v_buf, kv_cache.v_scale)):
            values, scale = quantize_int8(x)
            buf[loc] = values
            scales[layer_id][loc] = scale
        return
    k_buf[loc] = k.to(k_buf.dtype)
    v_buf[loc] = v.to(v_buf.dtype)


def quantize_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`x` `[tokens, heads, dim]` as int8 and its fp32 scale per (token, head): absmax / 127,
    so every value round-trips within half a step of its row's scale."""
    x = x.float()
    scale = x.abs().amax(-1).div_(127.0).clamp_min_(torch.finfo(torch.float32).tiny)
    values = torch.round(x / scale[..., None]).clamp_(-127, 127).to(torch.int8)
    return values, scale
