"""Suite-wide settings: no network, no W&B uploads, deterministic CPU threads."""

import contextlib
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest
import torch

# Triton kernels run on CPU tensors only in Triton's interpreter, which must be chosen
# before anything imports triton (transformers does). Auto backend selection never picks
# it on the CPU; tests that want the Triton path select it explicitly.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
    # Import it now: Triton builds its `tl` library for the interpreter only if
    # TRITON_INTERPRET=1 at its import, and some tests set it to 0 for a while.
    with contextlib.suppress(ImportError):
        import triton  # noqa: F401


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)
