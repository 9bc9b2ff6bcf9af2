"""The tiny model the astrai.remote tests serve, saved once (replicas: remote_helpers.py)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from tiny_parts import TINY_SHAPE

from astrai.tokenizer import AutoTokenizer


@pytest.fixture(scope="session")
def remote_model_dir(tmp_path_factory, save_model_dir, stdlib_tokenizer) -> Path:
    return save_model_dir(tmp_path_factory.mktemp("remote-model"), stdlib_tokenizer, **TINY_SHAPE)


@pytest.fixture(scope="session")
def remote_tokenizer(remote_model_dir) -> AutoTokenizer:
    return AutoTokenizer.from_pretrained(remote_model_dir)


@pytest.fixture
def one_thread() -> Iterator[None]:
    """The in-process reference engine computes as the replicas do: one torch thread."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
