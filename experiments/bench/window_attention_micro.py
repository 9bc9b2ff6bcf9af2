"""Microbenchmark of sliding-window decode attention on the CPU (issue #53): one layer's call
for 16 decode rows at 1k-4k contexts, window 128, paged head-major cache (random caches from
tests/extension/kv_cases.py), one thread, the calling thread's CPU time, median of 30. Beside
each other: the compiled kernel taking the window, SDPA over each request's window rows
(`windowed_attention`, the torch path) and full attention (what the layer would cost without
its window).

    python experiments/bench/window_attention_micro.py   # from the repository root
"""

from __future__ import annotations

import random
import statistics
import sys
import time
from collections.abc import Callable

import torch

sys.path.insert(0, "tests/extension")
from kv_cases import LAYER, make_case

from astrai.extension.backend import CpuPagedBackend
from astrai.extension.backend.windowed import windowed_attention

WINDOW = 128


def cpu_us(call: Callable[[], object], n: int = 30) -> float:
    for _ in range(3):
        call()
    times = []
    for _ in range(n):
        start = time.thread_time()
        call()
        times.append(time.thread_time() - start)
    return statistics.median(times) * 1e6


def main() -> None:
    torch.set_num_threads(1)
    kernel = CpuPagedBackend()
    print(f"decode, 16 rows, 8 heads / 4 KV heads x 64, window {WINDOW}, paged head-major")
    for context in (1024, 2048, 4096):
        random.seed(0)
        reqs = [(random.randint(context // 2, context), 1) for _ in range(16)]
        case = make_case(reqs, n_heads=8, n_kv_heads=4, head_dim=64, head_major=True)
        args = (case.q, case.k, case.v, case.cache, LAYER, 0.125)

        def windowed_kernel() -> object:
            case.cache.plan.clear()
            return kernel.forward(*args, WINDOW)

        def full_kernel() -> object:
            case.cache.plan.clear()
            return kernel.forward(*args)

        a = cpu_us(lambda: windowed_attention(*args, WINDOW))
        b = cpu_us(windowed_kernel)
        c = cpu_us(full_kernel)
        print(
            f"  contexts {context // 2}-{context}: SDPA over the window {a:.0f} us, "
            f"kernel with the window {b:.0f} us ({a / b:.2f}x), "
            f"kernel over the full context {c:.0f} us ({c / b:.2f}x)"
        )


if __name__ == "__main__":
    main()
