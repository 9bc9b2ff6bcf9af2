"""The compiled CPU kernel (`astrai.extension.cpu_kernels`): decode and short extend rows read
their K/V in place, through the page table or the contiguous row stride, in one call per
layer for every such row of the step, parallel over (request, KV head) items.

torch_native copies each decode row's whole context out of the pool (paged) or pads a
strided view to its segment's longest row before SDPA; here nothing is gathered, nothing is
padded, and each key row is loaded once for all query heads of its GQA group. Longer extend
rows (more than `EXTEND_MAX_Q` new tokens over a cached prefix, or a fresh prompt of more
than `FRESH_MAX_Q`) still go to SDPA's blocked kernel, which turns them into matrix products. Served on the CPU in fp32 with an fp32 or
int8 cache, when the kernel is built (`make setup`) and not turned off (`ASTR_CPU_KERNELS=0`);
auto selection otherwise falls through to torch_native. A sliding-window layer passes its
`window`: the kernel reads only each query's window, and long extend rows take SDPA over the
window's rows (`windowed.window_span`). Attention sinks (GPT-OSS) join the kernel's softmax
denominators; long extend rows with sinks go to `sinks.sink_span`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from astrai.extension.backend.base import AttentionBackend, shape_mismatch, write_kv
from astrai.extension.backend.sinks import sink_span
from astrai.extension.backend.torch_native import sdpa_request
from astrai.extension.backend.windowed import window_span
from astrai.extension.cpu_kernels import paged_attention_op
from astrai.extension.invariance import batch_invariant_enabled
from astrai.extension.kv_cache import KVCache

# Requests with more new tokens than these go to SDPA: their queries x keys form a product
# that a blocked matmul kernel runs faster than per-row dot products. Measured crossovers
# (one thread, 4 requests, 8 heads / 4 KV heads x 64; experiments/bench/engine.md, #52):
# over a cached prefix of 256-1024 tokens the kernel wins at 4 new tokens (0.72-0.93x SDPA's
# time) and loses from 8 (1.13-1.53x); over nothing cached it wins up to 32 (0.31-0.64x).
EXTEND_MAX_Q = 4
FRESH_MAX_Q = 32
_EMPTY = torch.empty(0)


@dataclass
class _KernelPlan:
    """The step's rows for the kernel (int64 host tensors, shared by every layer) and the
    long extend spans left to SDPA."""

    rows: torch.Tensor
    q_starts: torch.Tensor
    q_lens: torch.Tensor
    kv_lens: torch.Tensor
    sdpa_spans: list[tuple[int, int, int, int]]

    @classmethod
    def build(cls, kv_cache: KVCache) -> _KernelPlan:
        pool_rows = kv_cache.req_pool_indices_host or tuple(kv_cache.req_pool_indices.tolist())
        rows, starts, q_lens, kv_lens, sdpa = [], [], [], [], []
        for span in kv_cache.request_spans():
            i, start, q_len, kv_len = span
            if q_len > (FRESH_MAX_Q if q_len == kv_len else EXTEND_MAX_Q):
                sdpa.append(span)
                continue
            rows.append(pool_rows[i])
            starts.append(start)
            q_lens.append(q_len)
            kv_lens.append(kv_len)

        def as_tensor(values: list[int]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.int64)

        return cls(as_tensor(rows), as_tensor(starts), as_tensor(q_lens), as_tensor(kv_lens), sdpa)


class CpuPagedBackend(AttentionBackend):
    """`torch.ops.astrai_cpu.paged_attention` for fp32 queries on the CPU."""

    name = "cpu"
    takes_window = True
    takes_sinks = True

    def supports(self, q: torch.Tensor, kv_cache: KVCache) -> str | None:
        if q.device.type != "cpu":
            return f"runs on the CPU only, query is on {q.device.type}"
        if q.dtype != torch.float32:
            return f"query dtype {q.dtype} is not float32"
        k_buf = kv_cache.k_buffer
        if k_buf.dtype not in (torch.float32, torch.int8):
            return f"KV cache dtype {k_buf.dtype} is not float32 or int8"
        mismatch = shape_mismatch(q, kv_cache)
        if mismatch is not None:
            return mismatch
        if kv_cache.v_buffer.shape != k_buf.shape or kv_cache.v_buffer.stride() != k_buf.stride():
            return "K and V buffers differ in shape or layout (MLA's latent cache)"
        if k_buf.stride(-1) != 1:
            return "the KV buffers' last dimension is not dense"
        if batch_invariant_enabled():
            return "batch-invariant mode attends request by request (torch_native)"
        if paged_attention_op() is None:
            return "the CPU kernel is not built (`make setup`) or ASTR_CPU_KERNELS=0"
        return None

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: KVCache,
        layer_id: int,
        scale: float,
        window: int | None = None,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """As every backend's, plus `window` (a sliding-window layer's; None: full) and
        `sinks` (`[n_heads]` sink logits, or None)."""
        write_kv(k, v, kv_cache, layer_id)
        if q.shape[0] == 0:
            return torch.empty_like(q)
        plan = kv_cache.plan.get("cpu_kernel")
        if plan is None:
            plan = kv_cache.plan["cpu_kernel"] = _KernelPlan.build(kv_cache)
        op = paged_attention_op()
        assert op is not None  # supports() said so
        k_scale = _EMPTY if kv_cache.k_scale is None else kv_cache.k_scale[layer_id]
        v_scale = _EMPTY if kv_cache.v_scale is None else kv_cache.v_scale[layer_id]
        out = op(
            q.contiguous(),
            kv_cache.k_buffer[layer_id],
            kv_cache.v_buffer[layer_id],
            k_scale,
            v_scale,
            kv_cache.req_to_token,
            kv_cache.row_stride or 0,
            plan.rows,
            plan.q_starts,
            plan.q_lens,
            plan.kv_lens,
            scale,
            window or 0,
            _EMPTY if sinks is None else sinks.detach().float().contiguous(),
        )
        for span in plan.sdpa_spans:
            _, start, q_len, _ = span
            if sinks is not None:
                rows = sink_span(q, kv_cache, layer_id, scale, window, sinks, span)
            elif window is not None:
                rows = window_span(q, kv_cache, layer_id, scale, window, span)
            else:
                rows = sdpa_request(q, k, v, kv_cache, layer_id, scale, span)
            out[start : start + q_len] = rows
        return out
