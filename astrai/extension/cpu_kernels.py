"""The compiled CPU attention kernel (`csrc/cpu_attention.cpp`): built by `make setup`, loaded
if present, absent without harm.

The build goes through torch's own `cpp_extension` (ninja + the system C++ compiler, against
the installed torch's headers, OpenMP from torch's libgomp) into `csrc/build/`, under a name
that carries the source's hash, so a stale library is never loaded after the source changes.
Nothing compiles at run time: where the library is missing (no compiler at setup, another
torch), `paged_attention_op()` is None and the CPU engine keeps torch_native's SDPA path.
`ASTR_CPU_KERNELS=0` turns the kernel off for a process (the fallback's tests and A/B runs).

`python -m astrai.extension.build_kernel` builds it (what `make setup` runs).
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import sys
from collections.abc import Callable
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

ENV_VAR = "ASTR_CPU_KERNELS"
SOURCE = Path(__file__).resolve().parent / "csrc" / "cpu_attention.cpp"
BUILD_DIR = SOURCE.parent / "build"
CFLAGS = ["-O3", "-march=native", "-fopenmp", "-fno-math-errno", "-std=c++17"]


def library_name() -> str:
    """The library's name for the current source (the hash ties a build to its source)."""
    digest = hashlib.sha256(SOURCE.read_bytes()).hexdigest()[:10]
    return f"astrai_cpu_attention_{digest}"


def library_path() -> Path:
    return BUILD_DIR / f"{library_name()}.so"


def build(verbose: bool = False) -> Path:
    """Compile the kernel into `BUILD_DIR` (torch's cpp_extension; ninja from this venv)."""
    from torch.utils import cpp_extension

    # the ninja wheel installs its binary next to this interpreter, which may not be on PATH
    bin_dir = str(Path(sys.executable).parent)
    os.environ["PATH"] = bin_dir + os.pathsep + os.environ.get("PATH", "")
    BUILD_DIR.mkdir(parents=True, exist_ok=True)
    cpp_extension.load(
        name=library_name(),
        sources=[str(SOURCE)],
        extra_cflags=CFLAGS,
        extra_ldflags=["-fopenmp", "-lmvec"],
        build_directory=str(BUILD_DIR),
        is_python_module=False,
        verbose=verbose,
    )
    return library_path()


def enabled() -> bool:
    """False when `ASTR_CPU_KERNELS=0` (read at call time, so tests can flip it)."""
    return os.environ.get(ENV_VAR, "1").strip().lower() not in {"0", "false", "off", "no"}


@functools.cache
def _load() -> Callable[..., torch.Tensor] | None:
    path = library_path()
    if not path.exists():
        logger.info(
            "CPU attention kernel not built (%s missing; `make setup` builds it): "
            "the CPU engine uses torch_native's SDPA path",
            path.name,
        )
        return None
    try:
        torch.ops.load_library(str(path))
    except (OSError, RuntimeError) as err:  # built for another torch, or a missing symbol
        logger.warning("CPU attention kernel %s did not load (%s): using torch_native", path, err)
        return None
    return torch.ops.astrai_cpu.paged_attention


def paged_attention_op() -> Callable[..., torch.Tensor] | None:
    """`torch.ops.astrai_cpu.paged_attention`, or None (off, not built, or not loadable)."""
    return _load() if enabled() else None


def reset() -> None:
    """Forget whether the library loaded, so the next call looks again (tests move BUILD_DIR)."""
    _load.cache_clear()
