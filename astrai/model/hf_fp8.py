"""Block-fp8 checkpoints (DeepSeek-V3 / R1 official weights) dequantised on load.

Such a directory stores each quantised linear weight as `torch.float8_e4m3fn` with a companion
`<name>_scale_inv` (fp32, one scale per `weight_block_size` block, edge blocks cropped) and
declares `quantization_config: {quant_method: "fp8", weight_block_size: [bn, bk]}` in
`config.json`. We dequantise to a plain floating weight (`fp8.float() * scale_inv` per block,
the arithmetic of transformers' `FineGrainedFP8Config(dequantize=True)`) so the rest of the
loader and every kernel see an ordinary checkpoint.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

import torch

from astrai.model.directory import CONFIG_NAME

SCALE_SUFFIX = "_scale_inv"
_FP8 = {torch.float8_e4m3fn, torch.float8_e5m2}


class Fp8CheckpointError(ValueError):
    """A block-fp8 checkpoint whose scales or quantization_config do not fit its weights."""


def block_size(path: str | os.PathLike) -> tuple[int, int] | None:
    """`weight_block_size` of a directory's fp8 `quantization_config`, or None without one."""
    file = Path(path) / CONFIG_NAME
    data: dict[str, Any] = json.loads(file.read_text()) if file.is_file() else {}
    quant = data.get("quantization_config") or {}
    if quant.get("quant_method") != "fp8":
        return None
    block = quant.get("weight_block_size")
    if (
        not isinstance(block, (list, tuple))
        or len(block) != 2
        or not all(isinstance(b, int) and b > 0 for b in block)
    ):
        raise Fp8CheckpointError(
            f"{file}: quantization_config.weight_block_size must be two positive integers "
            f"(e.g. [128, 128]), got {block!r}"
        )
    return int(block[0]), int(block[1])


def dequantize_block(
    weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int], dtype: torch.dtype
) -> torch.Tensor:
    """`weight.float() * scale_inv` with each scale expanded over its block (cropped at edges)."""
    rows, cols = weight.shape[-2:]
    scale = scale_inv.float().repeat_interleave(block[0], dim=-2)[..., :rows, :]
    scale = scale.repeat_interleave(block[1], dim=-1)[..., :cols]
    return (weight.float() * scale).to(dtype)


def _floating_dtype(stored: dict[str, torch.Tensor]) -> torch.dtype:
    for tensor in stored.values():
        if tensor.is_floating_point() and tensor.dtype not in _FP8:
            return tensor.dtype
    return torch.bfloat16


def dequantize_state(
    stored: dict[str, torch.Tensor],
    block: tuple[int, int] | None,
    *,
    source: str,
    dtype: torch.dtype | None = None,
) -> dict[str, torch.Tensor]:
    """Replace every fp8 weight and its `_scale_inv` by the dequantised weight (in `dtype`, else
    the checkpoint's other floating dtype); a missing or misshapen scale names the tensor."""
    fp8 = [k for k, v in stored.items() if v.dtype in _FP8]
    scales = [k for k in stored if k.endswith(SCALE_SUFFIX)]
    if not fp8 and not scales:
        return stored
    if block is None:
        raise Fp8CheckpointError(
            f"{source}: fp8 tensors (e.g. {(fp8 or scales)[0]}) but config.json has no "
            "quantization_config with quant_method='fp8' and weight_block_size"
        )
    out_dtype = dtype if dtype is not None and dtype not in _FP8 else _floating_dtype(stored)
    out = {k: v for k, v in stored.items() if k not in fp8 and k not in scales}
    for key in fp8:
        scale_key = key + SCALE_SUFFIX
        if scale_key not in stored:
            raise Fp8CheckpointError(f"{source}: fp8 tensor {key} has no {scale_key}")
        weight, scale = stored[key], stored[scale_key]
        if weight.dim() < 2:
            raise Fp8CheckpointError(f"{source}: fp8 tensor {key} is not a matrix")
        rows, cols = weight.shape[-2:]
        want = (*weight.shape[:-2], math.ceil(rows / block[0]), math.ceil(cols / block[1]))
        if tuple(scale.shape) != want:
            raise Fp8CheckpointError(
                f"{source}: {scale_key} has shape {tuple(scale.shape)}; {key} of shape "
                f"{tuple(weight.shape)} with weight_block_size {list(block)} needs {want}"
            )
        out[key] = dequantize_block(weight, scale, block, out_dtype)
    orphans = [k for k in scales if k[: -len(SCALE_SUFFIX)] not in fp8]
    if orphans:
        raise Fp8CheckpointError(
            f"{source}: scale tensor {orphans[0]} has no fp8 weight {orphans[0][: -len(SCALE_SUFFIX)]}"
        )
    return out


__all__ = [
    "SCALE_SUFFIX",
    "Fp8CheckpointError",
    "block_size",
    "dequantize_block",
    "dequantize_state",
]
