"""MoE dispatch before / after issue #53: the expert loop that reads the per-expert offsets on
the host (`Experts._sorted`, the old path, kept for batch-invariant mode) against the
sync-free grouped path (`Experts._grouped`, two `torch._grouped_mm`), on the astrai-1b-moe
preset at test size (conf/hardware/cpu_smoke.yaml's dimensions: 64 experts, top-8).

A decode-shaped step: the model's forward on `[B, 1]` tokens (no KV cache, so attention is
trivial and the MoE layers dominate). Batches of <= 4 tokens (<= 32 token-expert pairs) take
the per-pair gather path in both columns. CPU time of the calling thread, median of 30.

    PYTHONPATH=. python experiments/bench/moe_dispatch.py   # from the repository root
"""

from __future__ import annotations

import logging
import os
import statistics
import time

import torch

from astrai.model import Transformer, preset
from astrai.model.moe import Experts

logger = logging.getLogger(__name__)
TEST_SIZE = dict(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=512,
    moe_intermediate_size=32,
)


def step_ms(model: Transformer, batch: int, n: int = 30) -> float:
    x = torch.randint(0, 512, (batch, 1), generator=torch.Generator().manual_seed(batch))
    with torch.no_grad():
        for _ in range(3):
            model(x)
        times = []
        for _ in range(n):
            start = time.thread_time()
            model(x)
            times.append(time.thread_time() - start)
    return statistics.median(times) * 1e3


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = Transformer(preset("astrai-1b-moe", **TEST_SIZE)).eval()
    grouped = Experts._grouped
    logger.info("uptime: %s", os.popen("uptime").read().strip())
    logger.info("| tokens (B) | pairs | before: host-offset loop (ms) | after: grouped_mm (ms) |")
    logger.info("|---|---|---|---|")
    for batch in (1, 4, 8, 16, 64, 256):
        Experts._grouped = Experts._sorted  # the pre-#53 path
        before = step_ms(model, batch)
        Experts._grouped = grouped
        after = step_ms(model, batch)
        logger.info("| %d | %d | %.3f | %.3f |", batch, 8 * batch, before, after)


if __name__ == "__main__":
    main()
