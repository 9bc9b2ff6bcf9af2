"""`python -m astrai.bench eval` runs end to end on a tiny workload (throughput is not checked
here); both lm-eval models must agree on every request of it."""

import json

import pytest

from astrai.bench.__main__ import bench_config, main
from astrai.bench.eval import workload
from astrai.tokenizer import AutoTokenizer


@pytest.mark.slow
def test_eval_benchmark_cli_writes_a_report(tmp_path):
    out = tmp_path / "eval.json"
    report = main(
        [
            "eval",
            "model=tiny",
            "questions=3",
            "context_min=8",
            "context_max=40",
            "choice_min=1",
            "choice_max=5",
            "hf_batch_sizes=[4]",
            "engine.page_size=4",
            f"out={out}",
        ]
    )
    saved = json.loads(out.read_text())
    assert saved["workload"]["requests"] == 12 == report["astrai"]["requests"]
    assert saved["hf"]["bs=4"]["requests"] == 12
    # The same requests, the same numbers: a wrong split or truncation would be far off.
    assert saved["max_abs_logprob_diff"] < 1e-4 and saved["greedy_disagreements"] == 0
    # A question's later choices found its context in the radix cache.
    assert saved["astrai"]["cached_prompt_tokens"] > 0
    assert saved["speedup_vs_hf"] > 0


def test_eval_benchmark_options():
    cfg = bench_config("eval")
    assert cfg["model"]["name"] == "astrai-30m" and cfg["engine"]["cache_mode"] == "paged"
    assert cfg["questions"] * cfg["choices"] >= 400
    cfg = bench_config("eval", ["engine=contiguous", "batch_size=8", "hf_batch_sizes=[1,8]"])
    assert cfg["engine"]["cache_mode"] == "contiguous" and cfg["batch_size"] == "8"
    with pytest.raises(SystemExit, match="unknown option 'question'"):
        bench_config("eval", ["+question=3"])


def test_workload_shares_contexts_and_checks_its_options():
    tok = AutoTokenizer.train(["def f(x):\n    return x + 1\n"] * 20, vocab_size=300)
    options = ["questions=5", "choices=3", "context_min=8", "context_max=32", "choice_max=4"]
    cfg = bench_config("eval", options)
    pairs = workload(cfg, tok)
    assert len(pairs) == 15
    for q in range(5):
        assert len({c for c, _ in pairs[3 * q : 3 * q + 3]}) == 1  # one context per question
    assert len({c for c, _ in pairs}) == 5
    with pytest.raises(ValueError, match="choice_min=5, choice_max=4"):
        workload({**cfg, "choice_min": 5}, tok)
    with pytest.raises(ValueError, match="max_length=32 < context_max"):
        main(["eval", "model=tiny", "max_length=32"])  # refused before building anything
