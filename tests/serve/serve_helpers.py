"""Helpers for the serve tests (a subprocess server's helpers: tests/server_process.py)."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]


def serve_config(overrides: list[str]) -> dict[str, Any]:
    """conf/serve.yaml composed with `overrides`, as `python -m astrai.serve` hands it to
    `serve(cfg)`."""
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose("serve", overrides=overrides)
    out = OmegaConf.to_container(cfg, resolve=True)
    assert isinstance(out, dict)
    return out


def wait_idle(engine, timeout: float = 30.0) -> None:
    """Until no task runs or waits and every KV page is free: the engine loop releases a
    finished request right after its step, possibly after its client got the answer."""
    deadline = time.monotonic() + timeout
    while True:
        s = engine.get_stats()
        if s["active_tasks"] == 0 and s["waiting_queue"] == 0 and engine.pool.all_free():
            return
        assert time.monotonic() < deadline, f"engine not idle after {timeout} s: {s}"
        time.sleep(0.005)


@contextlib.contextmanager
def served_engine_like(engine, **options: Any) -> Iterator[tuple[Any, str]]:
    """A server over a second engine on `engine`'s model and tokenizer (4 rows, contiguous
    cache, its context) with `options` on top: `(engine, url)`, shut down after."""
    from astrai.inference import InferenceEngine
    from astrai.serve import ServerThread, ServeSettings, create_app

    eng = InferenceEngine(
        engine.model,
        engine.tokenizer,
        max_batch_size=4,
        max_seq_len=engine.max_seq_len,
        cache_mode="contiguous",
        **options,
    )
    try:
        with ServerThread(create_app(eng, ServeSettings())) as srv:
            yield eng, srv.url
    finally:
        eng.shutdown()
