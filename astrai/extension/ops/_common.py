"""What every kernel wrapper checks before launching, so a call that cannot run raises."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager

import torch


class KernelUnavailable(RuntimeError):
    """A Triton kernel cannot run on these inputs (no Triton, wrong device, dtype or shape)."""


def interpreter_enabled() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def triton_missing() -> str | None:
    try:
        import triton  # noqa: F401
    except ImportError as err:
        return f"triton is not importable ({err})"
    return None


def unusable(*tensors: torch.Tensor) -> str | None:
    """Why the kernels cannot take these tensors, or None.

    CUDA tensors run compiled kernels; CPU tensors run only under `TRITON_INTERPRET=1`
    (set before Triton is imported), and not in bf16, whose `tl.dot` the interpreter gets
    wrong.
    """
    reason = triton_missing()
    if reason:
        return reason
    for t in tensors:
        if t.device.type == "cuda":
            continue
        if t.device.type != "cpu" or not interpreter_enabled():
            return f"{t.device.type} tensors need CUDA (or TRITON_INTERPRET=1 on the CPU)"
        if t.dtype == torch.bfloat16:
            return "bf16 is not supported by the Triton interpreter"
    return None


def check(*tensors: torch.Tensor) -> None:
    reason = unusable(*tensors)
    if reason:
        raise KernelUnavailable(reason)


def next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


_launch_depth = 0


@contextmanager
def launching() -> Iterator[None]:
    """Marks a kernel launch. On a GPU a launch dispatches no torch ops; Triton's CPU
    interpreter does (it copies tensors to numpy), which the decode-step checker in the
    tests must not mistake for host synchronisation in our code."""
    global _launch_depth
    _launch_depth += 1
    try:
        yield
    finally:
        _launch_depth -= 1


def in_kernel_launch() -> bool:
    return _launch_depth > 0
