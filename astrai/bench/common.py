"""Helpers shared by the benchmarks."""

from __future__ import annotations

import sysconfig
from pathlib import Path

from astrai.tokenizer import AutoTokenizer


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile, `q` in [0, 1]."""
    values = sorted(values)
    return values[min(len(values) - 1, round(q * (len(values) - 1)))]


def bench_tokenizer(vocab: int) -> AutoTokenizer:
    """A byte-level BPE trained on a little stdlib text; benchmarks use its special ids."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    texts = [p.read_text(errors="ignore") for p in sorted(stdlib.glob("*.py"))[:40]]
    return AutoTokenizer.train(texts, vocab_size=min(vocab, 2048))
