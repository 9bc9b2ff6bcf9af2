"""`bench scaling`: the four curves of astrai and (a fake) vLLM in one run, and the plots."""

from __future__ import annotations

import json

import pytest
from test_bench_vllm import fake_vllm  # noqa: F401  (the fixture: a stand-in vLLM package)

from astrai.bench.__main__ import bench_config, main
from astrai.bench.scaling import format_report, points, run

TINY = [
    "model=tiny",
    "concurrency=[1,3]",
    "concurrency_prompt=8",
    "concurrency_output=4",
    "prompt_lengths=[16,48]",
    "contexts=[16,40]",
    "context_output=5",
    "threads=1",
    "engine.max_batch_size=4",
    "engine.kv_tokens=512",
]
PNG = b"\x89PNG\r\n\x1a\n"


def test_grid_has_every_curve_and_its_lengths():
    cfg = bench_config("scaling", TINY)
    grid = points(cfg, 512)
    assert [(p["curve"], p["x"]) for p in grid] == [
        ("concurrency", 1),
        ("concurrency", 3),
        ("prompt_length", 16),
        ("prompt_length", 48),
        ("context", 16),
        ("context", 40),
    ]
    assert [len(grid[1]["work"]), len(grid[3]["work"][0][0]), grid[5]["work"][0][1]] == [3, 48, 5]
    assert all(len(p) == 8 and n == 4 for p, n in grid[1]["work"])


@pytest.mark.slow
def test_astrai_and_vllm_curves_and_plots(fake_vllm, tmp_path):  # noqa: F811
    cfg = bench_config("scaling", [*TINY, f"plots={tmp_path / 'plots'}"])
    report = run(cfg)
    rows = report["points"]
    assert report["vllm_version"] == "0.0-fake"
    assert len(rows) == 6 and all("astrai" in p and "vllm" in p for p in rows)
    conc = [p for p in rows if p["curve"] == "concurrency"]
    assert [p["astrai"]["tokens"] for p in conc] == [4, 12]  # every requested token came out
    assert all(p["astrai"]["rss_mib"] > 0 and p["vllm"]["rss_bytes"] > 0 for p in conc)
    assert conc[1]["astrai"]["kv_bytes_in_use"] > 0
    ctx = [p for p in rows if p["curve"] == "context"]
    assert all(p["astrai"]["decode_step_ms"] > 0 for p in ctx)
    # vLLM's child ran every point's work in one engine, in order
    log = [json.loads(line) for line in fake_vllm.read_text().splitlines()]
    generated = [e["generate"] for e in log if "generate" in e][1:]  # after the warm-up
    assert [len(g) for g in generated] == [1, 3, 1, 1, 1, 1]
    assert [len(g[0][0]) for g in generated[2:]] == [16, 48, 16, 40]
    assert sum("init" in e for e in log) == 1
    for name in report["plots"]:
        with open(name, "rb") as f:
            assert f.read(8) == PNG
    assert len(report["plots"]) == 4
    text = format_report(report)
    assert "decode_step_ms" in text and "vLLM-CPU" in text


def test_a_peer_that_is_not_a_scaling_peer_is_refused():
    with pytest.raises(SystemExit, match="not a scaling peer"):
        main(["scaling", *TINY, "peers=[hf]"])
