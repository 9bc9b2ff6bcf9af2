"""MXFP4 checkpoints (GPT-OSS's official weights) dequantised on load.

Such a directory declares `quantization_config: {quant_method: "mxfp4"}` and stores each
quantised expert tensor `<name>` as `<name>_blocks` (uint8 `[E, rows, G, 16]`: two FP4 e2m1
values per byte, the low nibble first, 32 values per block) and `<name>_scales` (uint8 `[E,
rows, G]`: one power-of-two exponent per block, biased by 127). The value of a block's
element is ``FP4[nibble] * 2 ** (scale - 127)``; the rows of `<name>` are the blocks' values
laid end to end, transposed to HF's `[E, cols, rows]` (transformers'
`integrations.mxfp4.convert_moe_packed_tensors`). The model then runs as a plain one (no
MXFP4 kernels); `hub.read_hf_state` calls this before the GPT-OSS layout translation.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from astrai.model.directory import CONFIG_NAME

BLOCKS, SCALES = "_blocks", "_scales"
#: the FP4 (e2m1) value of each nibble
FP4_VALUES = (
    0.0,
    0.5,
    1.0,
    1.5,
    2.0,
    3.0,
    4.0,
    6.0,
    -0.0,
    -0.5,
    -1.0,
    -1.5,
    -2.0,
    -3.0,
    -4.0,
    -6.0,
)


class Mxfp4CheckpointError(ValueError):
    """An MXFP4 checkpoint whose blocks and scales do not fit together; names the tensor."""


def quant_method(path: str | os.PathLike) -> str | None:
    """`quantization_config.quant_method` of a directory's `config.json`, or None."""
    file = Path(path) / CONFIG_NAME
    data = json.loads(file.read_text()) if file.is_file() else {}
    return (data.get("quantization_config") or {}).get("quant_method")


def dequantize_mxfp4(
    blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """`[E, rows, G, 16]` blocks and `[E, rows, G]` scales as the `[E, G * 32, rows]` tensor."""
    lut = torch.tensor(FP4_VALUES, dtype=torch.float32, device=blocks.device)
    blocks = blocks.to(torch.uint8)
    values = torch.stack([lut[(blocks & 0x0F).long()], lut[(blocks >> 4).long()]], dim=-1)
    values = values.flatten(-2)  # [E, rows, G, 32]: low nibble, then high, per byte
    exponent = scales.to(torch.int32) - 127
    values = torch.ldexp(values, exponent[..., None])
    return values.flatten(-2).transpose(1, 2).contiguous().to(dtype)


def _floating_dtype(stored: dict[str, torch.Tensor]) -> torch.dtype:
    for tensor in stored.values():
        if tensor.is_floating_point():
            return tensor.dtype
    return torch.bfloat16


def dequantize_state(
    stored: dict[str, torch.Tensor],
    method: str | None,
    *,
    source: str,
    dtype: torch.dtype | None = None,
) -> dict[str, torch.Tensor]:
    """Replace every `<name>_blocks` / `<name>_scales` pair of an MXFP4 checkpoint by
    `<name>` dequantised (to `dtype`, else the checkpoint's other floating dtype); any other
    checkpoint passes through."""
    if method != "mxfp4":
        return stored
    out_dtype = dtype or _floating_dtype(stored)
    out = {k: v for k, v in stored.items() if not k.endswith((BLOCKS, SCALES))}
    for key in stored:
        if not key.endswith(BLOCKS):
            continue
        name = key[: -len(BLOCKS)]
        blocks, scales = stored[key], stored.get(name + SCALES)
        if scales is None:
            raise Mxfp4CheckpointError(f"{source}: MXFP4 tensor {key} has no {name}{SCALES}")
        if (
            blocks.dim() != 4
            or blocks.shape[-1] != 16
            or tuple(blocks.shape[:-1]) != tuple(scales.shape)
        ):
            raise Mxfp4CheckpointError(
                f"{source}: {key} {tuple(blocks.shape)} and {name}{SCALES} "
                f"{tuple(scales.shape)} are not [E, rows, G, 16] and [E, rows, G]"
            )
        out[name] = dequantize_mxfp4(blocks, scales, out_dtype)
    orphans = [k for k in stored if k.endswith(SCALES) and k[: -len(SCALES)] + BLOCKS not in stored]
    if orphans:
        raise Mxfp4CheckpointError(f"{source}: MXFP4 scales {orphans[0]} have no blocks")
    return out


__all__ = [
    "FP4_VALUES",
    "Mxfp4CheckpointError",
    "dequantize_mxfp4",
    "dequantize_state",
    "quant_method",
]
