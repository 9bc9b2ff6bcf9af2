"""Packing benchmark: how much of a packed window is padding, greedy in order vs best-fit
decreasing (``prepare packing_strategy=greedy|bfd``, :mod:`astrai.data.packing`).

1. The built-in SFT data (``builtin:arithmetic/sft``, ``arithmetic/tools``, ``countdown/sft``)
   prepared with ``pack=true`` at each window size, both strategies: windows, tokens and the
   padding fraction (the share of window slots left empty when every window is padded to
   ``window_size``), and the prepare time.
2. A long-tailed synthetic length distribution (log-normal, clipped to the window), packed by
   :func:`~astrai.data.packing.greedy_bins` and :func:`~astrai.data.packing.bfd_bins`
   directly, with the lower bound ``ceil(tokens / window)`` windows for scale.

``python -m astrai.bench packing`` (options: ``conf/bench/packing.yaml``).
"""

from __future__ import annotations

import logging
import math
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from astrai.data.builtin import stdlib_corpus
from astrai.data.packing import bfd_bins, greedy_bins, padding_fraction
from astrai.data.prepare import prepare
from astrai.tokenizer import AutoTokenizer

log = logging.getLogger(__name__)

STRATEGIES = ("greedy", "bfd")


def _tokenizer(cfg: dict[str, Any]) -> tuple[Any, str]:
    if cfg["tokenizer_path"]:
        return AutoTokenizer.from_pretrained(cfg["tokenizer_path"]), cfg["tokenizer_path"]
    tok = AutoTokenizer.train(stdlib_corpus("train", max_bytes=2_000_000), cfg["tokenizer_vocab"])
    return tok, f"byte-level BPE, vocab {tok.vocab_size}, trained on 2 MB of stdlib"


def bench_builtin(cfg: dict[str, Any], tok: Any, work: Path) -> list[dict[str, Any]]:
    """Padding fraction of the built-in SFT sources packed by each strategy."""
    rows = []
    for source in cfg["sources"]:
        for window in cfg["windows"]:
            for strategy in STRATEGIES:
                t0 = time.perf_counter()
                r = prepare(
                    "sft",
                    f"builtin:{source}",
                    work / f"{source.replace('/', '_')}-{window}-{strategy}",
                    tok,
                    pack=True,
                    window_size=window,
                    packing_strategy=strategy,
                    builtin={"n": cfg["records"], "seed": cfg["seed"]},
                    progress=False,
                    overwrite=True,
                )
                slots = r.windows * window
                rows.append(
                    {
                        "source": source,
                        "window": window,
                        "strategy": strategy,
                        "documents": r.documents,
                        "tokens": r.tokens,
                        "windows": r.windows,
                        "min_windows": math.ceil(r.tokens / window),
                        "padding_fraction": 1 - r.tokens / slots if slots else 0.0,
                        "seconds": time.perf_counter() - t0,
                    }
                )
    return rows


def bench_synthetic(cfg: dict[str, Any]) -> list[dict[str, Any]]:
    """Padding fraction of log-normal document lengths packed by each strategy."""
    rng = np.random.default_rng(cfg["seed"])
    rows = []
    for window in cfg["windows"]:
        raw = rng.lognormal(math.log(cfg["median_tokens"]), cfg["sigma"], cfg["documents"])
        lengths = np.clip(raw.astype(np.int64), 1, window).tolist()
        for strategy, pack in (("greedy", greedy_bins), ("bfd", bfd_bins)):
            t0 = time.perf_counter()
            bins = pack(lengths, window)
            rows.append(
                {
                    "window": window,
                    "strategy": strategy,
                    "documents": len(lengths),
                    "tokens": int(sum(lengths)),
                    "windows": len(bins),
                    "min_windows": math.ceil(sum(lengths) / window),
                    "padding_fraction": padding_fraction(lengths, bins, window),
                    "pack_seconds": time.perf_counter() - t0,
                }
            )
    return rows


def run(cfg: dict[str, Any]) -> dict[str, Any]:
    tok, described = _tokenizer(cfg)
    with tempfile.TemporaryDirectory(dir=cfg["workdir"] or None) as work:
        builtin = bench_builtin(cfg["builtin"], tok, Path(work))
    return {
        "config": cfg,
        "tokenizer": described,
        "builtin": builtin,
        "synthetic": bench_synthetic(cfg["synthetic"]),
    }


def format_report(report: dict[str, Any]) -> str:
    lines = [f"tokenizer: {report['tokenizer']}", "built-in SFT data (prepare pack=true):"]
    for r in report["builtin"]:
        lines.append(
            f"  {r['source']:<16} window {r['window']:>5} {r['strategy']:<6} "
            f"{r['documents']:>6} docs {r['tokens']:>9,} tokens -> {r['windows']:>6} windows "
            f"(min {r['min_windows']}), padding {r['padding_fraction']:.2%}, {r['seconds']:.1f}s"
        )
    syn = report["config"]["synthetic"]
    lines.append(
        f"synthetic log-normal lengths (median {syn['median_tokens']}, sigma {syn['sigma']}, "
        f"clipped to the window):"
    )
    for r in report["synthetic"]:
        lines.append(
            f"  window {r['window']:>5} {r['strategy']:<6} {r['documents']:>7} docs "
            f"{r['tokens']:>11,} tokens -> {r['windows']:>7} windows (min {r['min_windows']}), "
            f"padding {r['padding_fraction']:.2%}, packed in {r['pack_seconds']:.2f}s"
        )
    return "\n".join(lines)
