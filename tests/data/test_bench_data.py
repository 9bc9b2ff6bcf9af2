"""Smoke test of the data benchmark's pieces at toy size (the benchmark itself is not a test)."""

from __future__ import annotations

from pathlib import Path

import pytest

from astrai.bench.__main__ import parse_overrides
from astrai.bench.data import DEFAULTS, index_job, write_corpus


def test_corpus_and_random_access_report(tmp_path: Path) -> None:
    cfg = {**DEFAULTS, "tokens": 50_000, "doc_min": 10, "doc_max": 500, "window_size": 64}
    cfg |= {"reads": 100, "doc_reads": 100}
    corpus = write_corpus(cfg, tmp_path / "c.h5")
    assert corpus["tokens"] == 50_000 and corpus["dtype"] == "uint16"
    report = index_job(str(tmp_path / "c.h5"), cfg)
    assert report["windows"] == (50_000 - 65) // 64 + 1
    assert report["rss_growth_mb"] >= 0 and report["window_reads_per_s"] > 0


def test_overrides_are_typed_by_the_defaults() -> None:
    got = parse_overrides(["tokens=1000", "workdir=/tmp", "tokenizer=123"], DEFAULTS)
    assert got == {"tokens": 1000, "workdir": "/tmp", "tokenizer": "123"}
    with pytest.raises(SystemExit, match="unknown option 'token'"):
        parse_overrides(["token=5"], DEFAULTS)
    with pytest.raises(SystemExit, match="expected int"):
        parse_overrides(["reads=many"], DEFAULTS)
