"""The serve benchmark's structured-output option runs end to end (figures not checked)."""

import json

import pytest

from astrai.bench.__main__ import bench_config, main
from astrai.bench.serve import STRUCTURED_FORMAT


def test_structured_option_defaults_off():
    assert bench_config("serve", [])["structured"] is False
    assert bench_config("serve", ["structured=true"])["structured"] is True


@pytest.mark.slow
def test_serve_benchmark_structured_option(tmp_path):
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
            "structured=true",
            f"out={out}",
        ]
    )
    saved = json.loads(out.read_text())
    # The schema cannot complete: constrained requests run to max_tokens like plain ones.
    assert saved["http_structured"]["tokens"] == saved["http"]["tokens"] > 0
    assert saved["offline_structured"]["tokens"] == saved["offline"]["tokens"]
    assert saved["offline_structured_cpu_ratio"] > 0
    assert saved["http_structured"]["errors"] == 0
    assert saved["structured_ratio"] > 0
    assert STRUCTURED_FORMAT["json_schema"]["schema"]["properties"]["answer"]["minLength"] > 1000
