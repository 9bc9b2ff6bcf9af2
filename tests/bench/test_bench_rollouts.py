"""`python -m astrai.bench rollouts` end to end on a tiny workload (throughput is not checked
here): every mode draws the same seeds, so all generate the same completions, and only the
group mode finds the prompts' pages in the prefix cache."""

import json

import pytest

from astrai.bench.__main__ import main


def test_rollouts_benchmark_cli_writes_a_report(tmp_path):
    out = tmp_path / "rollouts.json"
    report = main(
        [
            "rollouts",
            "model=tiny",
            "prompts=2",
            "batches=2",
            "num_generations=3",
            "max_new_tokens=4",
            "few_shot=1",
            "engine.max_batch_size=8",
            "engine.max_seq_len=256",
            "engine.page_size=4",
            f"out={out}",
        ]
    )
    saved = json.loads(out.read_text())
    rows = saved["rows"]
    assert set(rows) == {"group", "separate", "contiguous"}
    assert {r["completions"] for r in rows.values()} == {12}
    assert len({r["tokens"] for r in rows.values()}) == 1  # the same completions
    prompt = saved["prompt_len"]
    assert prompt > 40  # one worked problem before each prompt
    # each prompt's two followers found its full pages (before its last token)
    full_pages = sum(2 * ((len_ - 1) // 4 * 4) for len_ in [int(prompt)] * 4)
    assert rows["group"]["cached_prompt_tokens"] >= 0.8 * full_pages
    assert (
        rows["separate"]["cached_prompt_tokens"] == rows["contiguous"]["cached_prompt_tokens"] == 0
    )
    assert report["group_vs_separate"] > 0


def test_rollouts_benchmark_refuses_an_unknown_mode():
    with pytest.raises(ValueError, match="modes: unknown"):
        main(["rollouts", "model=tiny", "modes=[group,fast]", "batches=1", "prompts=1"])
