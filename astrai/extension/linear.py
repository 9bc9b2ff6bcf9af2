"""The model's matmul: `F.linear`, routed to oneDNN for fp32 CPU inference.

MKL's sgemm, which `F.linear` uses on the CPU, is slow for the skinny batches of decoding
and for wide outputs: on the benchmark machine a `[32, 512] x [512, 8192]` vocab projection
took 8.4 ms through it and 4.0 ms through oneDNN's inner product, and a whole decode step
is 10-15% faster. oneDNN has no autograd formula here, so the route is taken only when
gradients are off (serving, rollouts, evaluation) and only for fp32 tensors on the CPU;
training, GPUs and half precision keep `F.linear`. Results differ from `F.linear` only by
summation order (about 1e-6 relative in fp32).

oneDNN has a fixed cost of about 9 us per call, which dominates tiny products whose weights
sit in the CPU's cache: one decoding row through a cached 256 x 704 projection takes 9.4 us
with `F.linear` and 18.1 us with oneDNN. With weights streamed from memory (a model larger
than the last-level cache) oneDNN is as fast or faster at every size (55 vs 44 us for the
same product), so `small_on_aten` is set per layer by the caller that knows the model
(`astrai.model.layers.mark_cache_resident`): products of at most `ONEDNN_MIN_MACS`
multiply-adds (rows x in x out) of a cache-resident model stay on `F.linear`
(`experiments/bench/engine.md`).
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

import torch
import torch.nn.functional as F

_ONEDNN = (
    torch.backends.mkldnn.is_available()
    and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    and os.environ.get("ASTR_ONEDNN_LINEAR", "1") != "0"
)


# rows x in_features x out_features up to which F.linear beats oneDNN on cached weights
ONEDNN_MIN_MACS = 1 << 20
_CACHE_FALLBACK = 8 << 20  # bytes assumed when the OS does not say


def last_level_cache_bytes(root: Path = Path("/sys/devices/system/cpu/cpu0/cache")) -> int:
    """Size of the CPU's largest cache (Linux sysfs under `root`; 8 MiB when unknown)."""
    best = 0
    for size in root.glob("index*/size"):
        with contextlib.suppress(OSError, ValueError):
            text = size.read_text().strip().upper()
            unit = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
            best = max(best, int(text.rstrip("KMG")) * unit)
    return best or _CACHE_FALLBACK


def onednn_linear_enabled() -> bool:
    """Whether fp32 CPU inference matmuls go through oneDNN (`ASTR_ONEDNN_LINEAR=0` disables)."""
    return _ONEDNN


def prepack_weight(weight: torch.Tensor, rows: int) -> torch.Tensor | None:
    """`weight` reordered once into oneDNN's blocked layout for products of about `rows`
    rows, or None where `linear` would not take oneDNN (no oneDNN, not fp32 on the CPU).

    Given a plain weight, oneDNN's inner product reorders it on every call: on the
    benchmark machine (2 threads) a 16 x 512 x 3072 product took 224 us with the plain
    weight and 138 us prepacked, 48 rows 478 and 376 us, with bit-identical results at 16
    rows and more (experiments/bench/engine.md). A prepacked weight is a copy: its owner
    (`astrai.model.layers.PackedLinear`) keeps it in step with the parameter."""
    if not (_ONEDNN and weight.device.type == "cpu" and weight.dtype == torch.float32):
        return None
    with torch.inference_mode():
        return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), max(1, rows))


def linear(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None = None,
    *,
    small_on_aten: bool = False,
    prepacked: torch.Tensor | None = None,
) -> torch.Tensor:
    """`F.linear(x, weight, bias)`; oneDNN for fp32 on the CPU with gradients off, except
    for products of at most `ONEDNN_MIN_MACS` when `small_on_aten` (cache-resident weights).
    `prepacked` (`prepack_weight`'s) serves the oneDNN route; `weight` may then be None
    when that route is certain (fp32 CPU inference of a model that is not cache-resident)."""
    out_features = (prepacked if prepacked is not None else weight).shape[0]
    if (
        _ONEDNN
        and not torch.is_grad_enabled()
        and x.device.type == "cpu"
        and x.dtype == torch.float32
        and x.dim() >= 2
        and not (small_on_aten and x.numel() * out_features <= ONEDNN_MIN_MACS)
    ):
        if prepacked is not None:
            return torch.ops.mkldnn._linear_pointwise(x, prepacked, bias, "none", [], "")
        if weight.dtype == torch.float32 and weight.device.type == "cpu":
            return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
    return F.linear(x, weight, bias)
