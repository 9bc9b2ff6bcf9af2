"""The model's matmul: `F.linear`, routed to oneDNN for fp32 CPU inference.

MKL's sgemm, which `F.linear` uses on the CPU, is slow for the skinny batches of decoding
and for wide outputs: on the benchmark machine a `[32, 512] x [512, 8192]` vocab projection
took 8.4 ms through it and 4.0 ms through oneDNN's inner product, and a whole decode step
is 10-15% faster. oneDNN has no autograd formula here, so the route is taken only when
gradients are off (serving, rollouts, evaluation) and only for fp32 tensors on the CPU;
training, GPUs and half precision keep `F.linear`. Results differ from `F.linear` only by
summation order (about 1e-6 relative in fp32).

oneDNN has a fixed cost of about 9 us per call, which dominates tiny products: one decoding
request through a 256 x 704 projection takes 9.5 us with `F.linear` and 18.6 us with
oneDNN, while at 16 rows oneDNN is already ahead (48 vs 66 us). Products of at most
`ONEDNN_MIN_MACS` multiply-adds (rows x in x out) therefore stay on `F.linear`; the
threshold is where the two meet on the benchmark machine (`experiments/bench/engine.md`).
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

_ONEDNN = (
    torch.backends.mkldnn.is_available()
    and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    and os.environ.get("ASTR_ONEDNN_LINEAR", "1") != "0"
)


# rows x in_features x out_features below which F.linear is faster than oneDNN (see above)
ONEDNN_MIN_MACS = 1 << 20


def onednn_linear_enabled() -> bool:
    """Whether fp32 CPU inference matmuls go through oneDNN (`ASTR_ONEDNN_LINEAR=0` disables)."""
    return _ONEDNN


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear(x, weight, bias)`; oneDNN for fp32 on the CPU with gradients off."""
    if (
        _ONEDNN
        and not torch.is_grad_enabled()
        and x.device.type == "cpu"
        and x.dtype == torch.float32
        and weight.dtype == torch.float32
        and weight.device.type == "cpu"
        and x.dim() >= 2
        and x.numel() * weight.shape[0] > ONEDNN_MIN_MACS
    ):
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
    return F.linear(x, weight, bias)
