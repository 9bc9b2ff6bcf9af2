"""Microbenchmark of the CPU attention kernel against torch_native (issue #52): one layer's
attention call on random caches (tests/extension/kv_cases.py), one thread, CPU time of the
calling thread (so another process on the machine disturbs it little), median of 30.

    python experiments/bench/cpu_attention_micro.py   # from the repository root
"""

from __future__ import annotations

import random
import statistics
import sys
import time

import torch

sys.path.insert(0, "tests/extension")
from kv_cases import LAYER, make_case

from astrai.extension.backend import CpuPagedBackend, TorchNativeBackend, cpu_paged


def cpu_us(backend, case, n: int = 30) -> float:
    for _ in range(3):
        backend.forward(case.q, case.k, case.v, case.cache, LAYER, 0.125)
    times = []
    for _ in range(n):
        case.cache.plan.clear()
        start = time.thread_time()
        backend.forward(case.q, case.k, case.v, case.cache, LAYER, 0.125)
        times.append(time.thread_time() - start)
    return statistics.median(times) * 1e6


def decode() -> None:
    print("decode: contexts 16-512, head-major storage")
    for heads, kv_heads, dim in [(8, 4, 64), (16, 4, 64), (8, 2, 128)]:
        for batch in (1, 16, 48):
            for layout in ("contiguous", "paged"):
                random.seed(0)
                reqs = [(random.randint(16, 512), 1) for _ in range(batch)]
                case = make_case(
                    reqs,
                    n_heads=heads,
                    n_kv_heads=kv_heads,
                    head_dim=dim,
                    contiguous=layout == "contiguous",
                    head_major=True,
                )
                a, b = cpu_us(TorchNativeBackend(), case), cpu_us(CpuPagedBackend(), case)
                print(
                    f"  {heads}/{kv_heads} heads d{dim} batch {batch} {layout}: "
                    f"torch_native {a:.0f} us, kernel {b:.0f} us, {a / b:.2f}x"
                )


def extend() -> None:
    print("extend: 4 requests, 8 heads / 4 KV heads x 64, contiguous rows")
    limits = (cpu_paged.EXTEND_MAX_Q, cpu_paged.FRESH_MAX_Q)
    for prefix in (0, 256, 1024):
        for q_len in (4, 8, 16, 32, 64):
            case = make_case(
                [(prefix, q_len)] * 4,
                n_heads=8,
                n_kv_heads=4,
                head_dim=64,
                contiguous=True,
                head_major=True,
            )
            cpu_paged.EXTEND_MAX_Q = cpu_paged.FRESH_MAX_Q = 10**6
            kernel = cpu_us(CpuPagedBackend(), case)
            cpu_paged.EXTEND_MAX_Q = cpu_paged.FRESH_MAX_Q = 0
            sdpa = cpu_us(CpuPagedBackend(), case)
            print(
                f"  prefix {prefix} new {q_len}: kernel {kernel:.0f} us, SDPA {sdpa:.0f} us, "
                f"kernel/SDPA {kernel / sdpa:.2f}"
            )
    cpu_paged.EXTEND_MAX_Q, cpu_paged.FRESH_MAX_Q = limits


if __name__ == "__main__":
    torch.set_num_threads(1)
    decode()
    extend()
