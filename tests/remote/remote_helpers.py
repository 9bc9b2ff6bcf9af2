"""Replicas for the astrai.remote tests: `python -m astrai.serve` subprocesses over the
tiny model (one torch thread each, free ports), and LoRA adapters for them."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch
from server_process import free_port, stop, wait_healthy

from astrai.model import AutoModel, LoRAConfig, inject_lora, save_lora
from astrai.model.lora import LoRALinear

ROOT = Path(__file__).resolve().parents[2]
LORA_TARGETS = ["q_proj", "v_proj", "o_proj", "down_proj"]
LORA_RANK = 4


def adapter_model(model_dir: Path, seed: int) -> torch.nn.Module:
    """The model of `model_dir` wrapped with a rank-4 adapter whose B is random (B starts
    at zero: a no-op adapter would make any test of it pass)."""
    model = AutoModel.from_pretrained(model_dir)
    torch.manual_seed(seed)
    inject_lora(model, LoRAConfig(r=LORA_RANK, lora_alpha=8.0, target_modules=LORA_TARGETS))
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, LoRALinear):
                torch.nn.init.normal_(module.lora_B.weight, std=0.2)
    return model


def make_adapter_dir(model_dir: Path, out: Path, seed: int) -> Path:
    return save_lora(adapter_model(model_dir, seed), out)


def start_replica(model_dir: Path, *extra: str) -> tuple[subprocess.Popen, str]:
    """`python -m astrai.serve` on `model_dir` with weight updates on; its URL once healthy."""
    port = free_port()
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "astrai.serve",
            f"model_path={model_dir}",
            f"port={port}",
            "engine=contiguous",
            "engine.max_batch_size=8",
            "engine.max_seq_len=256",
            "threads=1",
            "allow_weight_updates=true",
            "log_level=warning",
            *extra,
        ],
        cwd=ROOT,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(proc, url, 180)
    except BaseException:
        stop(proc)
        raise
    return proc, url
