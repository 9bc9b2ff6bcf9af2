"""`python -m astrai.bench chunked_loss` end to end at toy sizes (the figures are not checked,
only that every configuration ran in its own process and the report's arithmetic holds)."""

import json

import pytest

from astrai.bench.__main__ import main


@pytest.mark.slow
def test_chunked_loss_benchmark_writes_a_report(tmp_path):
    out = tmp_path / "report.json"
    main(
        [
            "chunked_loss",
            "strategies=[grpo]",  # each configuration is a process of its own: few of them
            "vocab_sizes=[512,1024]",
            "sft_shape=[1,24]",
            "grpo_shape=[4,24]",
            "num_generations=4",
            "grpo_prompt_tokens=8",
            "logits_chunk_size=7",
            "steps=1",
            "warmup=0",
            f"out={out}",
        ]
    )
    rows = json.loads(out.read_text())["rows"]
    assert {(r["strategy"], r["head"], r["vocab_size"]) for r in rows} == {
        ("grpo", h, v) for h in ("chunked", "dense") for v in (512, 1024)
    }
    for r in rows:
        assert r["peak_rss_mb"] > 0 and r["baseline_rss_mb"] > 0
        assert r["dense_logits_mb"] == pytest.approx(
            r["shape"][0] * r["shape"][1] * r["vocab_size"] * 4 / 2**20
        )
        if r["vocab_size"] == 512:
            assert r["excess_mb"] == 0.0
        if r["head"] == "chunked":
            assert r["step_time_over_dense"] > 0
