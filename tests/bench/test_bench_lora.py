"""`python -m astrai.bench serve lora=...`: the LoRA throughput benchmark end to end on a tiny
workload. The report's structure and that every ratio is a positive number are checked;
throughput itself is not (no wall-clock thresholds)."""

import json

import pytest

from astrai.bench.__main__ import bench_config, main
from astrai.bench.lora import adapter_counts, format_report


def test_lora_benchmark_writes_a_report(tmp_path):
    out = tmp_path / "lora.json"
    report = main(
        [
            "serve",
            "model=tiny",
            "lora=[1,4]",
            "requests=4",
            "lora_prompt_len=6",
            "lora_output_len=3",
            "lora_rank=4",
            "lora_targets=[q_proj,v_proj,down_proj]",
            "engine.max_batch_size=2",  # raised to `requests`: one batch
            f"out={out}",
        ]
    )
    saved = json.loads(out.read_text())
    assert saved["rows"].keys() == report["rows"].keys()
    rows = saved["rows"]
    assert list(rows) == ["base", "base_lora_engine", "adapters_1", "adapters_4"]
    for name, row in rows.items():
        assert row["tokens"] == 4 * 3, name  # every request ran to its length
        assert isinstance(row["tokens_per_s"], float) and row["tokens_per_s"] > 0
        assert isinstance(row["ratio_vs_base"], float) and row["ratio_vs_base"] > 0
        assert 0.0 <= row["changed_vs_base"] <= 1.0
    assert rows["base"]["ratio_vs_base"] == 1.0 and rows["base"]["changed_vs_base"] == 0.0
    assert rows["base_lora_engine"]["changed_vs_base"] == 0.0  # no adapter: the base's output
    w = saved["workload"]
    assert (w["requests"], w["rank"], w["targets"]) == (4, 4, ["q_proj", "v_proj", "down_proj"])
    target = saved["target"]
    assert target["adapters"] == 4 and target["min_ratio"] == 0.8
    assert target["ratio"] == rows["adapters_4"]["ratio_vs_base"] and isinstance(
        target["met"], bool
    )
    text = format_report(report)
    assert "adapters_4" in text and "target >= 0.8x" in text


def test_lora_option_spellings():
    assert adapter_counts(True) == [1, 4, 16]
    assert adapter_counts(16) == [16]
    assert adapter_counts([16, 1, 4, 4]) == [1, 4, 16]
    assert adapter_counts("1,4") == [1, 4]
    for bad in (0, [1, -2], "many", False):
        with pytest.raises(ValueError, match="lora="):
            adapter_counts(bad)
    assert bench_config("serve", ["lora=16"])["lora"] == 16
    assert bench_config("serve", ["lora=[1,4,16]"])["lora"] == [1, 4, 16]
    assert bench_config("serve")["lora"] is None  # the HTTP benchmark by default
