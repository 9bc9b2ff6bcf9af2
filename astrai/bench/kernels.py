"""Kernel benchmark (CUDA): paged split-KV decode attention vs the device's copy bandwidth.

Decode attention is memory-bound: each step reads every cached K and V once. The achieved
bandwidth (bytes of K/V read / kernel time) is reported as a fraction of the bandwidth a
plain device-to-device copy reaches on the same GPU in the same run (target >= 70% at
batch >= 16). Shapes default to Qwen3-0.6B's attention (16 query heads, 8 KV heads,
head_dim 128, bf16); the page table is a random permutation of the pool (one-token pages).
"""

from __future__ import annotations

import functools
import logging
from typing import Any

import torch
from tqdm import tqdm

from astrai.bench.common import as_list
from astrai.extension import ops

logger = logging.getLogger(__name__)


def _time_cuda(fn, iters: int) -> float:
    """Median seconds per call, timed with CUDA events after a warm-up."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return sorted(times)[len(times) // 2]


def copy_bandwidth(mib: int, iters: int) -> float:
    """Bytes/s of a device-to-device copy (read + write counted)."""
    src = torch.empty(mib * 2**20, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    seconds = _time_cuda(lambda: dst.copy_(src), iters)
    return 2 * src.numel() / seconds


def run(cfg: dict[str, Any]) -> dict[str, Any]:
    """Decode attention at every batch size x sequence length of conf/bench/kernels.yaml."""
    if not torch.cuda.is_available():
        raise SystemExit("the kernels benchmark needs a CUDA device")
    dtype = getattr(torch, cfg["dtype"])
    h, hkv, d = cfg["n_heads"], cfg["n_kv_heads"], cfg["head_dim"]
    copy_bw = copy_bandwidth(cfg["copy_mib"], cfg["iters"])
    report: dict[str, Any] = {
        "device": torch.cuda.get_device_name(),
        "config": cfg,
        "copy_bandwidth_gbs": copy_bw / 1e9,
        "decode": [],
    }
    cases = [
        (int(b), int(s)) for b in as_list(cfg["batch_sizes"]) for s in as_list(cfg["seq_lens"])
    ]
    for batch, seq in tqdm(cases, desc="decode attention"):
        size = batch * seq
        k_buf = torch.randn(size, hkv, d, device="cuda", dtype=dtype)
        v_buf = torch.randn_like(k_buf)
        table = torch.randperm(size, device="cuda").to(torch.int32).view(batch, seq)
        rows = torch.arange(batch, device="cuda")
        lens = torch.full((batch,), seq, dtype=torch.int32, device="cuda")
        q = torch.randn(batch, h, d, device="cuda", dtype=dtype)
        out = torch.empty_like(q)
        part_o = torch.empty(batch, h, cfg["num_splits"], d, device="cuda")
        part_l = torch.empty(batch, h, cfg["num_splits"], device="cuda")

        step = functools.partial(
            ops.decode_attention,
            q,
            k_buf,
            v_buf,
            table,
            rows,
            lens,
            d**-0.5,
            num_splits=cfg["num_splits"],
            out=out,
            partial_out=part_o,
            partial_lse=part_l,
        )
        seconds = _time_cuda(step, cfg["iters"])
        bytes_read = 2 * size * hkv * d * k_buf.element_size()
        bw = bytes_read / seconds
        report["decode"].append(
            {
                "batch": batch,
                "seq_len": seq,
                "us": seconds * 1e6,
                "bandwidth_gbs": bw / 1e9,
                "fraction_of_copy": bw / copy_bw,
            }
        )
    return report


def format_report(report: dict[str, Any]) -> str:
    lines = [
        f"{report['device']}: device copy {report['copy_bandwidth_gbs']:.0f} GB/s",
        "batch  seq_len      us     GB/s  of copy",
    ]
    for r in report["decode"]:
        lines.append(
            f"{r['batch']:5d}  {r['seq_len']:7d}  {r['us']:7.1f}  {r['bandwidth_gbs']:7.0f}  "
            f"{r['fraction_of_copy']:6.0%}"
        )
    return "\n".join(lines)
