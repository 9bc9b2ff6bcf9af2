"""Suite-wide settings: no network, no W&B uploads, deterministic CPU threads; under
pytest-xdist (`make test` runs two workers) each worker gets its share of the cores, the
files with the most slow tests start first, and `shared_build` builds an expensive folder
(a reference training run, the prepared data) once for all workers of the session."""

import contextlib
import os
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest
import torch
from shared_build import SharedBuild

# pytest-xdist names each worker in its environment; a run without workers has neither.
XDIST_WORKER = os.environ.get("PYTEST_XDIST_WORKER")
if XDIST_WORKER is not None:
    # Each worker its share of the cores (2 workers on 2 cores: 1 thread each), set before
    # any test runs; subprocesses inherit it through OMP_NUM_THREADS (astrai's thread policy
    # reads it), so the multi-process runs do not oversubscribe the machine either.
    _cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    _workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (_cores or 1) // _workers)))
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))

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
    if XDIST_WORKER is not None:
        _slowest_files_first(items)
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


def _slowest_files_first(items: list[pytest.Item]) -> None:
    """Files in order of their count of `slow` tests, most first (a stable sort: the tests
    of a file keep their order). xdist hands out whole files in collection order, so the long
    ones start early and the two workers finish together instead of one waiting on the
    last long file."""
    slow = Counter(item.path for item in items if "slow" in item.keywords)
    items.sort(key=lambda item: -slow[item.path])


@pytest.fixture(scope="session")
def shared_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder of this session that every xdist worker sees (the parent of the workers'
    own base temps); without workers, under the session's base temp."""
    base = tmp_path_factory.getbasetemp()
    path = (base.parent if XDIST_WORKER is not None else base) / "shared"
    path.mkdir(exist_ok=True)
    return path


@pytest.fixture(scope="session")
def shared_build(shared_dir: Path) -> SharedBuild:
    return SharedBuild(shared_dir / "builds")


def _save_model_dir(path: Path, tok: Any, *, seed: int = 0, **config: Any) -> Path:
    """A random-weight model directory (config, safetensors and the tokenizer `tok`), as
    `make train` would export it; `config` overrides the tiny defaults."""
    from astrai.model import ModelConfig, Transformer, save_pretrained

    defaults = dict(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        max_position_embeddings=256,
    )
    cfg = ModelConfig(vocab_size=len(tok), **{**defaults, **config})
    torch.manual_seed(seed)
    save_pretrained(Transformer(cfg), path, tokenizer=tok)
    return Path(path)


def _build_model_dir(
    path: Path, texts: list[str], *, vocab_size: int = 300, seed: int = 0, **config: Any
) -> Path:
    """`_save_model_dir` with a BPE tokenizer trained on `texts`."""
    from astrai.tokenizer import AutoTokenizer

    tok = AutoTokenizer.train(texts, vocab_size=vocab_size)
    return _save_model_dir(path, tok, seed=seed, **config)


@pytest.fixture(scope="session")
def build_model_dir() -> Callable[..., Path]:
    """Factory of tiny model directories for tests that load one from disk."""
    return _build_model_dir


@pytest.fixture(scope="session")
def save_model_dir() -> Callable[..., Path]:
    """Factory of tiny model directories with a given tokenizer."""
    return _save_model_dir


@pytest.fixture(scope="session")
def stdlib_tokenizer() -> Any:
    """The suite's 384-token BPE on the first ten `[a-c]*.py` files of the standard library
    (tests/tiny_parts.py), trained once per session for the inference and serve tests."""
    from tiny_parts import STDLIB_VOCAB, stdlib_texts

    from astrai.tokenizer import AutoTokenizer

    return AutoTokenizer.train(stdlib_texts(), vocab_size=STDLIB_VOCAB)


@pytest.fixture
def decoding_threads(tokenizer, monkeypatch) -> set[str]:
    """Names of the threads on which any request's text is decoded: the directory's
    `tokenizer` fixture hands out recording stream decoders for the test."""
    import threading

    seen: set[str] = set()
    make = tokenizer.stream_decoder

    class Recording:
        def __init__(self, **kw: Any) -> None:
            self.inner = make(**kw)

        def step(self, token_id: int) -> str:
            seen.add(threading.current_thread().name)
            return self.inner.step(token_id)

        def flush(self) -> str:
            seen.add(threading.current_thread().name)
            return self.inner.flush()

    monkeypatch.setattr(tokenizer, "stream_decoder", lambda **kw: Recording(**kw))
    return seen
