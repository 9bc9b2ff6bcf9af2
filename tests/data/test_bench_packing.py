"""Smoke test of the packing benchmark at toy size (the benchmark itself is not a test)."""

from __future__ import annotations

from pathlib import Path

import pytest

from astrai.bench.__main__ import bench_config
from astrai.bench.packing import format_report, run


def test_packing_report_at_toy_size(tmp_path: Path, tok_dir: Path) -> None:
    cfg = bench_config(
        "packing",
        [
            f"tokenizer_path={tok_dir}",
            f"workdir={tmp_path}",
            "builtin.sources=[arithmetic/tools]",
            "builtin.windows=[256]",
            "builtin.records=60",
            "synthetic.windows=[1024]",
            "synthetic.documents=400",
        ],
    )
    cfg.pop("out"), cfg.pop("log_level")
    report = run(cfg)
    built = {r["strategy"]: r for r in report["builtin"]}
    assert built.keys() == {"greedy", "bfd"} and built["bfd"]["tokens"] == built["greedy"]["tokens"]
    syn = {r["strategy"]: r for r in report["synthetic"]}
    for rows in (built, syn):
        for r in rows.values():
            assert r["min_windows"] <= r["windows"]
            slots = r["windows"] * r["window"]
            assert r["padding_fraction"] == pytest.approx(1 - r["tokens"] / slots, abs=1e-12)
    assert syn["bfd"]["windows"] < syn["greedy"]["windows"]  # long-tailed: BFD packs tighter
    assert "padding" in format_report(report)
