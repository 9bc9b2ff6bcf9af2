"""Weight-sync benchmark: seconds per `WeightSender.push` to one replica over gloo, by model
size, against the memory-bandwidth bound of the copy.

For each model shape (`sizes` of `models`: name -> `ModelConfig` fields, random weights), one
`python -m astrai.serve` replica process (`allow_weight_updates=true`, `threads` torch
threads) serves a saved copy; this process holds the trainer's model and pushes all of
its parameters `repeats` times (after `warmup` pushes), each a new policy version. Every
push goes the whole way: names and shapes over HTTP, the handshake, each tensor broadcast
over gloo (loopback TCP) into the replica's buffer and copied into its engine's
parameter. The bound is measured in the same run: a plain `torch` copy of the same
tensors into preallocated ones (`dst.copy_(src)`, the bytes a push must move at least once,
read and written once), timed the same way. Options: ``conf/bench/weight_sync.yaml``.
"""

from __future__ import annotations

import logging
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from astrai.bench.common import bench_tokenizer, free_port, wait_healthy
from astrai.model import ModelConfig, Transformer, save_pretrained
from astrai.remote import ReplicaClient, WeightSender

logger = logging.getLogger(__name__)

REPO = Path(__file__).resolve().parents[2]


def start_replica(model_dir: Path, threads: int) -> tuple[subprocess.Popen, str]:
    port = free_port()
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "astrai.serve",
            f"model_path={model_dir}",
            f"port={port}",
            "engine=contiguous",
            "engine.max_batch_size=4",
            "engine.max_seq_len=256",
            f"threads={threads}",
            "allow_weight_updates=true",
            "log_level=warning",
        ],
        cwd=REPO,
        env={**os.environ, "OMP_NUM_THREADS": str(threads)},
    )
    url = f"http://127.0.0.1:{port}"
    wait_healthy(proc, url)
    return proc, url


def copy_seconds(tensors: list[torch.Tensor], repeats: int) -> list[float]:
    """Seconds per plain copy of every tensor into a preallocated one of its shape."""
    targets = [torch.empty_like(t) for t in tensors]
    times = []
    for _ in range(repeats + 1):
        start = time.perf_counter()
        for dst, src in zip(targets, tensors):
            dst.copy_(src)
        times.append(time.perf_counter() - start)
    return times[1:]  # the first one faults the pages in


def bench_model(name: str, shape: dict[str, Any], cfg: dict[str, Any]) -> dict[str, Any]:
    tokenizer = bench_tokenizer(int(shape.get("vocab_size", 2048)))
    config = ModelConfig(**shape)
    torch.manual_seed(0)
    model = Transformer(config)
    params = [p.detach() for p in model.parameters()]
    nbytes = sum(p.numel() * p.element_size() for p in params)
    with tempfile.TemporaryDirectory() as tmp:
        save_pretrained(model, Path(tmp) / name, tokenizer=tokenizer)
        proc, url = start_replica(Path(tmp) / name, cfg["threads"])
        client = ReplicaClient(url)
        sender = WeightSender([client], timeout=600)
        try:
            pushes = []
            for version in range(1, cfg["warmup"] + cfg["repeats"] + 1):
                with torch.no_grad():
                    for p in params:  # new weights every time: a new policy
                        p.add_(1e-3)
                pushes.append(sender.push(model.named_parameters(), version=version))
            assert client.policy_version() == version
        finally:
            sender.close()
            proc.terminate()
            proc.wait(timeout=60)
    pushes = pushes[cfg["warmup"] :]
    copies = copy_seconds(params, cfg["repeats"])
    push, copy = statistics.median(pushes), statistics.median(copies)
    row = {
        "model": name,
        "parameters": sum(p.numel() for p in params),
        "tensors": len(params),
        "bytes": nbytes,
        "push_s": pushes,
        "copy_s": copies,
        "push_median_s": push,
        "copy_median_s": copy,
        "push_gb_per_s": nbytes / push / 1e9,
        "copy_gb_per_s": nbytes / copy / 1e9,
        "push_over_copy": push / copy,
    }
    logger.info(
        "%s: %.1fM parameters, push %.4f s, copy %.4f s (%.1fx)",
        name,
        row["parameters"] / 1e6,
        push,
        copy,
        push / copy,
    )
    return row


def run(cfg: dict[str, Any]) -> dict[str, Any]:
    torch.set_num_threads(int(cfg["threads"]))
    logging.getLogger("httpx").setLevel(logging.WARNING)  # a line per request otherwise
    models = cfg["models"]
    unknown = [s for s in cfg["sizes"] if s not in models]
    if unknown:
        raise SystemExit(f"sizes: {unknown[0]!r} is not one of models ({', '.join(models)})")
    rows = [bench_model(str(name), dict(models[name]), cfg) for name in cfg["sizes"]]
    return {
        "benchmark": "weight_sync",
        "backend": "gloo",
        "threads": cfg["threads"],
        "repeats": cfg["repeats"],
        "load_average": os.getloadavg(),
        "rows": rows,
    }


def format_report(report: dict[str, Any]) -> str:
    lines = [
        f"weight sync over gloo to 1 replica process ({report['threads']} thread(s) each; "
        f"median of {report['repeats']}; load average {report['load_average'][0]:.2f})",
        f"{'model':>6} {'params':>8} {'MB':>7} {'push s':>8} {'GB/s':>6} "
        f"{'copy s':>8} {'GB/s':>6} {'push/copy':>9}",
    ]
    for r in report["rows"]:
        lines.append(
            f"{r['model']:>6} {r['parameters'] / 1e6:7.1f}M {r['bytes'] / 1e6:7.1f} "
            f"{r['push_median_s']:8.4f} {r['push_gb_per_s']:6.2f} {r['copy_median_s']:8.4f} "
            f"{r['copy_gb_per_s']:6.2f} {r['push_over_copy']:9.1f}"
        )
    return "\n".join(lines)
