"""Smoke test of the data benchmark's pieces at toy size (the benchmark itself is not a test)."""

from __future__ import annotations

from pathlib import Path

import pytest

from astrai.bench.__main__ import bench_config
from astrai.bench.data import index_job, write_corpus


def test_corpus_and_random_access_report(tmp_path: Path) -> None:
    cfg = {**bench_config("data"), "tokens": 50_000, "doc_min": 10, "doc_max": 500}
    cfg |= {"window_size": 64, "reads": 100, "doc_reads": 100}
    corpus = write_corpus(cfg, tmp_path / "c.h5")
    assert corpus["tokens"] == 50_000 and corpus["dtype"] == "uint16"
    report = index_job(str(tmp_path / "c.h5"), cfg)
    assert report["windows"] == (50_000 - 65) // 64 + 1
    assert report["rss_growth_mb"] >= 0 and report["window_reads_per_s"] > 0


def test_overrides_are_typed_by_the_defaults() -> None:
    """conf/bench/data.yaml composed by Hydra; values typed like the defaults."""
    got = bench_config("data", ["tokens=1000", "workdir=/tmp", "tokenizer_path=123"])
    assert (got["tokens"], got["workdir"], got["tokenizer_path"]) == (1000, "/tmp", "123")
    assert got["reads"] == 20_000 and got["out"] is None  # conf/bench/data.yaml defaults
    with pytest.raises(SystemExit, match="Could not override 'token'"):
        bench_config("data", ["token=5"])
    with pytest.raises(SystemExit, match="unknown option 'token'"):
        bench_config("data", ["+token=5"])
    with pytest.raises(SystemExit, match="expected int"):
        bench_config("data", ["reads=many"])
