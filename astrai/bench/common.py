"""Helpers shared by the benchmarks."""

from __future__ import annotations

import socket
import subprocess
import sysconfig
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from astrai.tokenizer import AutoTokenizer

if TYPE_CHECKING:
    import torch

    from astrai.model import Transformer


def as_list(value: Any) -> list[Any]:
    """A list option given as a list (``[1,8,all]``), a comma string (``"1,8"``) or one value."""
    if isinstance(value, (list, tuple)):
        return list(value)
    return [v.strip() for v in value.split(",")] if isinstance(value, str) else [value]


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile, `q` in [0, 1]."""
    values = sorted(values)
    return values[min(len(values) - 1, round(q * (len(values) - 1)))]


def throughput(tokens: int, seconds: float, ttft: list[float]) -> dict[str, float]:
    """The figures every generation workload reports: tokens, wall time, tokens/s, TTFT."""
    return {
        "tokens": tokens,
        "seconds": seconds,
        "tokens_per_s": tokens / seconds,
        "ttft_p50": percentile(ttft, 0.5),
        "ttft_p99": percentile(ttft, 0.99),
    }


def bench_tokenizer(vocab: int) -> AutoTokenizer:
    """A byte-level BPE trained on a little stdlib text; benchmarks use its special ids."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    texts = [p.read_text(errors="ignore") for p in sorted(stdlib.glob("*.py"))[:40]]
    return AutoTokenizer.train(texts, vocab_size=min(vocab, 2048))


def model_name(cfg: dict[str, Any]) -> str:
    """The benchmark's model for reports: the preset's name, or the model directory."""
    spec = cfg["model"]
    return str(spec.get("name") or spec.get("path"))


def bench_model(cfg: dict[str, Any]) -> tuple[Transformer, AutoTokenizer, torch.device]:
    """The model of the `model` group (`cfg["model"]`, a conf/model/ factory: a preset with
    random weights) on `cfg["device"]` in `cfg.get("dtype")` (fp32 by default), with
    `cfg["threads"]` (0: torch's default) and `cfg["seed"]` applied, and a tokenizer that
    fits its vocabulary. Imports torch only when called: the serve benchmark's client process
    imports this module too."""
    import torch
    from hydra.utils import instantiate

    if cfg["threads"]:
        torch.set_num_threads(int(cfg["threads"]))
    torch.manual_seed(cfg["seed"])
    device = torch.device(cfg["device"])
    model = instantiate(cfg["model"])(device=device)
    model = model.to(getattr(torch, cfg.get("dtype", "float32"))).eval()
    return model, bench_tokenizer(model.config.vocab_size), device


def report_header(cfg: dict[str, Any], model: Transformer, device: torch.device) -> dict[str, Any]:
    """The fields every benchmark report starts with: its config, model, size and machine."""
    import torch

    return {
        "config": cfg,
        "model": model_name(cfg),
        "parameters": model.num_parameters(),
        "device": str(device),
        "threads": torch.get_num_threads(),
    }


def free_port() -> int:
    """A port free on 127.0.0.1 now (for a server process the benchmark starts)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_healthy(
    proc: subprocess.Popen, url: str, *, timeout: float = 600, log: Path | None = None
) -> None:
    """Wait until the server `proc` answers `url`/health; a server that exits or stays
    silent past `timeout` seconds is killed and named (with its `log`'s tail when given)."""
    import httpx

    deadline = time.monotonic() + timeout
    while True:
        try:
            if httpx.get(url + "/health").status_code == 200:
                return
        except httpx.TransportError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            tail = f":\n{log.read_text(errors='replace')[-3000:]}" if log is not None else ""
            raise RuntimeError(f"the server at {url} did not start (exit {proc.poll()}){tail}")
        time.sleep(0.5)
