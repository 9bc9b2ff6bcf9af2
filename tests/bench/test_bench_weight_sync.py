"""`python -m astrai.bench weight_sync` end to end on the tiny shape (the speed is not
checked): a replica process takes every push, each row has its timings and the bound."""

import json

import pytest

from astrai.bench.__main__ import main


@pytest.mark.slow  # a server subprocess
def test_weight_sync_benchmark_writes_a_report(tmp_path):
    out = tmp_path / "report.json"
    report = main(["weight_sync", "sizes=[tiny]", "repeats=2", "warmup=1", f"out={out}"])
    saved = json.loads(out.read_text())
    assert saved == json.loads(json.dumps(report))
    (row,) = saved["rows"]
    assert row["model"] == "tiny" and len(row["push_s"]) == 2 and len(row["copy_s"]) == 2
    assert row["bytes"] == 4 * row["parameters"]  # fp32, every parameter pushed
    assert row["push_over_copy"] == row["push_median_s"] / row["copy_median_s"]


def test_an_unknown_size_is_refused_before_anything_starts():
    with pytest.raises(SystemExit, match="sizes: 'huge' is not one of models"):
        main(["weight_sync", "sizes=[huge]"])
