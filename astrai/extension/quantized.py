"""Int8 weight-only linear layers for inference (`engine.quantization=int8_weight_only`).

The quantization math is torchao's (`Int8WeightOnlyConfig` with its default `PerRow()`
granularity: symmetric, one fp32 scale per output channel, int8 in [-128, 127], computed by
`torchao.quantization.quant_primitives`); the product is torch's int8 weight-only kernel,
`torch.ops.aten._weight_int8pack_mm`, the one torchao's own CPU path was written for. It is
not torchao's `Int8Tensor` subclass: without `torch.compile` that subclass converts the whole
int8 weight to the activation's dtype on every call and then multiplies (on the benchmark
machine slower than fp32 at every shape, experiments/bench/quantization.md), and the engine
runs eagerly. The activations stay in their dtype: only the weights are rounded.

Where the kernel is fast: torch vectorizes `_weight_int8pack_mm` for AVX-512 and for ARM
(NEON) CPUs, and has a CUDA kernel; on an AVX2-only x86 CPU (the benchmark machine) it runs
a scalar loop, several times slower than the fp32 product (the record says by how much), so
there the option saves nothing but trades accuracy: `int8_linear_vectorized` says which.

torchao is an optional dependency (the `quant` extra); it is imported when an engine first
quantizes, and its absence is an error naming the extra.
"""

from __future__ import annotations

import logging
import platform

import torch

from astrai.extension.invariance import batch_invariant_enabled, in_row_blocks

logger = logging.getLogger(__name__)

#: engine.quantization's values (None: off), with the spellings accepted for each: SGLang's
#: `--torchao-config int8wo` (vLLM has no name of its own for int8 weight-only; it takes
#: torchao configs through `quantization="torchao"`)
QUANTIZATIONS: dict[str, str] = {
    "int8_weight_only": "int8_weight_only",
    "int8wo": "int8_weight_only",
}


def check_quantization(value: object) -> str | None:
    """`engine.quantization` as its canonical name (None: off); anything else is a
    ValueError naming the key and the accepted values."""
    if value is None:
        return None
    if isinstance(value, str) and value in QUANTIZATIONS:
        return QUANTIZATIONS[value]
    names = ", ".join(["null", *QUANTIZATIONS])
    raise ValueError(f"engine.quantization must be one of {names}; got {value!r}")


def int8_linear_vectorized(device: torch.device) -> bool:
    """Whether `_weight_int8pack_mm` has a vectorized kernel on `device`: CUDA, an AVX-512
    x86 CPU or an ARM CPU (NEON)."""
    if device.type != "cpu":
        return True
    if platform.machine().lower() in ("aarch64", "arm64"):
        return True
    return torch.backends.cpu.get_cpu_capability().startswith("AVX512")


def _torchao_primitives() -> tuple:
    try:
        # torchao logs a warning per CUDA-only library that a CPU build of torch cannot load
        quiet = logging.getLogger("torchao")
        level = quiet.level
        quiet.setLevel(logging.ERROR)
        try:
            from torchao.quantization.quant_primitives import (
                MappingType,
                choose_qparams_affine,
                quantize_affine,
            )
        finally:
            quiet.setLevel(level)
    except ImportError as err:
        raise ImportError(
            "engine.quantization needs torchao: pip install 'astrai[quant]' (or torchao)"
        ) from err
    return MappingType, choose_qparams_affine, quantize_affine


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`weight` `[out, in]` as int8 `[out, in]` and fp32 per-output-channel scales `[out]`
    (torchao's symmetric per-row int8: ``weight ~= qweight * scales[:, None]``)."""
    mapping, choose_qparams, quantize = _torchao_primitives()
    block = (1, weight.shape[-1])
    with torch.inference_mode():
        w = weight.detach()
        scales, zero_points = choose_qparams(
            w,
            mapping.SYMMETRIC,
            block,
            torch.int8,
            quant_min=-128,
            quant_max=127,
            eps=torch.finfo(torch.float32).eps,
            scale_dtype=torch.float32,
            zero_point_dtype=torch.int8,
        )
        qweight = quantize(w, block, scales, zero_points, torch.int8, quant_min=-128, quant_max=127)
    return qweight, scales.reshape(-1)


def int8_linear(
    x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """``x @ (qweight * scales[:, None]).T + bias`` through `_weight_int8pack_mm` (the
    activations in their own dtype); in batch-invariant mode in fixed row blocks."""
    if batch_invariant_enabled() and x.dim() >= 2:
        return in_row_blocks(x, lambda rows: _int8_linear(rows, qweight, scales, bias))
    return _int8_linear(x, qweight, scales, bias)


def _int8_linear(
    x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    flat = x.reshape(-1, x.shape[-1])
    if not flat.is_contiguous():
        flat = flat.contiguous()
    out = torch.ops.aten._weight_int8pack_mm(flat, qweight, scales.to(x.dtype))
    if bias is not None:
        out = out + bias
    return out.reshape(*x.shape[:-1], qweight.shape[0])
