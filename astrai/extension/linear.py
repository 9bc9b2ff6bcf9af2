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

oneDNN compiles (JIT) one primitive per product shape and keeps it in two caches of 1024
entries each (its own, `ONEDNN_PRIMITIVE_CACHE_CAPACITY`, and ideep's, `LRU_CACHE_CAPACITY`),
about 0.6 MB apiece whatever the weight's size. A server's row counts change every step
(batch sizes, prompt lengths, speculative drafts), so a long-running server kept compiling
new ones: its memory grew for hours (issue #44: +18.5% from minute 2 to minute 10 of a
soak). Bounded here by design: a oneDNN product runs at one of `row_bucket`'s row counts
(exact up to 16, then rounded up to one of eight sizes per octave, at most 12.5% padding
rows), and a product of more than `ROW_CHUNK` rows runs as its largest multiple of
`ROW_CHUNK` rows plus the rest at a bucket. A weight shape then has at most 48
(`ROW_BUCKETS`) + R / 256 primitives for products of up to R rows (a prefill step's
budget, `max_prefill_tokens`, plus its decode rows: 55 at the default 2048), about 0.6 MB
each: bounded, and compiled within the first minutes of traffic. Cost: about 2% of the
engine benchmark's tokens per CPU second, the padding rows' products (docs/engine.md, "The
CPU path"; experiments/bench/soak.md).
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from astrai.extension.invariance import batch_invariant_enabled, in_row_blocks

_ONEDNN = (
    torch.backends.mkldnn.is_available()
    and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    and os.environ.get("ASTR_ONEDNN_LINEAR", "1") != "0"
)


# rows x in_features x out_features up to which F.linear beats oneDNN on cached weights
ONEDNN_MIN_MACS = 1 << 20
_CACHE_FALLBACK = 8 << 20  # bytes assumed when the OS does not say
# rows up to which a oneDNN product runs at its own row count; above, 8 sizes per octave
EXACT_ROWS = 16
# products of more rows run as a multiple of this many rows plus a bucketed rest
ROW_CHUNK = 256


def row_bucket(rows: int) -> int:
    """The row count a oneDNN product of `rows` (1..ROW_CHUNK) rows runs at: `rows` itself
    up to `EXACT_ROWS` (decoding's small batches pay no padding), above that rounded up to a
    multiple of an eighth of the power of two below it (18, 20, ..., 32, 36, ..., 240, 256):
    at most 12.5% padding rows, 8 primitives per octave."""
    if rows <= EXACT_ROWS:
        return rows
    step = (1 << ((rows - 1).bit_length() - 1)) // 8
    return -(-rows // step) * step


# every row count a oneDNN product runs at: at most this many primitives per weight shape
ROW_BUCKETS = tuple(sorted({row_bucket(n) for n in range(1, ROW_CHUNK + 1)}))


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
    when that route is certain (fp32 CPU inference of a model that is not cache-resident).
    In batch-invariant mode (`astrai.extension.invariance`) the product runs in fixed blocks
    of `INVARIANT_ROWS` rows, each block by the route above."""
    if batch_invariant_enabled() and x.dim() >= 2 and not isinstance(x, DTensor):
        return in_row_blocks(x, lambda rows: _linear(rows, weight, bias, small_on_aten, prepacked))
    return _linear(x, weight, bias, small_on_aten, prepacked)


def _linear(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    small_on_aten: bool,
    prepacked: torch.Tensor | None,
) -> torch.Tensor:
    out_features = (prepacked if prepacked is not None else weight).shape[0]
    if (
        _ONEDNN
        and not torch.is_grad_enabled()
        and x.device.type == "cpu"
        and x.dtype == torch.float32
        and x.dim() >= 2
        and not isinstance(x, DTensor)  # tensor parallelism: torch's sharding rules
        and not (small_on_aten and x.numel() * out_features <= ONEDNN_MIN_MACS)
    ):
        if prepacked is not None:
            return _onednn(x, prepacked, bias, out_features)
        if weight.dtype == torch.float32 and weight.device.type == "cpu":
            return _onednn(x, weight, bias, out_features)
    return F.linear(x, weight, bias)


def _onednn(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, out_features: int
) -> torch.Tensor:
    """oneDNN's product at bounded row counts only: `row_bucket`'s, multiples of `ROW_CHUNK`."""
    rows = x.numel() // x.shape[-1]
    if rows <= EXACT_ROWS:  # decoding's usual case: as it comes, nothing to pad
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
    flat = x.reshape(rows, x.shape[-1])
    if rows <= ROW_CHUNK:
        out = _bucketed(flat, weight, bias)
    else:  # one product of a multiple of ROW_CHUNK rows (256-row pieces ran 3% slower)
        main = rows - rows % ROW_CHUNK
        out = torch.ops.mkldnn._linear_pointwise(flat[:main], weight, bias, "none", [], "")
        if main != rows:
            out = torch.cat([out, _bucketed(flat[main:], weight, bias)])
    return out.reshape(*x.shape[:-1], out_features)


def _bucketed(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    rows = x.shape[0]
    bucket = row_bucket(rows)
    if bucket != rows:  # zero rows below: their products are computed and dropped
        x = F.pad(x, (0, 0, 0, bucket - rows))
    out = torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
    return out[:rows] if bucket != rows else out
