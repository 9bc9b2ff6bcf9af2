"""The engine benchmark runs end to end on a tiny workload (figures are not checked here)."""

import json

import pytest

from astrai.bench.__main__ import main


@pytest.mark.slow
def test_engine_benchmark_cli_writes_a_report(tmp_path):
    out = tmp_path / "engine.json"
    report = main(
        [
            "engine",
            "model=tiny",
            "requests=3",
            "prompt_min=4",
            "prompt_max=12",
            "output_min=2",
            "output_max=5",
            "hf_batch_sizes=1,all",
            "prefix_requests=3",
            "prefix_len=64",
            f"out={out}",
        ]
    )
    saved = json.loads(out.read_text())
    assert saved["astrai"]["tokens"] == report["astrai"]["tokens"] > 0
    # Both systems produced exactly the requested (useful) tokens.
    assert {r["tokens"] for r in saved["transformers"].values()} == {saved["astrai"]["tokens"]}
    assert saved["prefix"]["ttft_ratio"] > 0


def test_unknown_option_is_refused():
    with pytest.raises(SystemExit, match="requestz"):
        main(["engine", "requestz=3"])


@pytest.mark.slow
def test_serve_benchmark_cli_runs(tmp_path):
    out = tmp_path / "serve.json"
    main(
        [
            "serve",
            "model=tiny",
            "requests=3",
            "prompt_min=4",
            "prompt_max=8",
            "output_min=2",
            "output_max=4",
            f"out={out}",
        ]
    )
    saved = json.loads(out.read_text())
    assert saved["http"]["tokens"] == saved["offline"]["tokens"] > 0
