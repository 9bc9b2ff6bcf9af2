"""`bench quant`: each variant's decode speed and accuracy against the fp32 baseline."""

from __future__ import annotations

import pytest

from astrai.bench.__main__ import bench_config, main
from astrai.bench.quant import format_report, run

TINY = ["model=tiny", "batches=[1,2]", "repeats=1", "steps=2", "ppl_docs=2", "ppl_tokens=48"]
TINY += ["agree_prompts=2", "agree_tokens=8", "engine.max_prefill_tokens=16"]


@pytest.mark.slow
def test_int8_kv_variant_against_fp32():
    report = run(bench_config("quant", [*TINY, "variants=[{},{kv_cache_dtype:int8}]"]))
    speeds = report["decode_tokens_per_s"]
    assert set(speeds) == {"fp32", "kv_cache_dtype=int8"}
    assert all(v > 0 for per in speeds.values() for v in per.values())
    acc = report["accuracy"]
    # int8 K/V move the perplexity a little, never to a different model
    assert abs(acc["ppl_change_kv_cache_dtype=int8"]) < 0.05
    assert acc["ppl_fp32"] > 1 and 0 < acc["agreement_kv_cache_dtype=int8"] <= 1
    assert "kv_cache_dtype=int8" in format_report(report)


def test_variants_must_be_engine_settings():
    with pytest.raises(SystemExit, match="variants"):
        main(["quant", *TINY, "variants=[int8]"])
