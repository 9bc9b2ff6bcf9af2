"""`python -m astrai.bench grpo_async` end to end on a tiny run (the speed is not checked):
both modes train, every timed step is reported, the asynchronous trainer waits less."""

import json

import pytest

from astrai.bench.__main__ import main


@pytest.mark.slow
def test_grpo_async_benchmark_writes_a_report(tmp_path):
    data = tmp_path / "data"
    overrides = [
        "model=tiny",
        "tokenizer.train.max_bytes=400000",
        "tokenizer.train.vocab_size=512",
        "data.train.prepare.builtin.n=32",
        "data.batch_size=2",
        "strategy.init_from=null",
        "strategy.num_generations=2",
        "strategy.max_new_tokens=4",
        f"paths.data_dir={data}",
    ]
    out = tmp_path / "report.json"
    report = main(
        [
            "grpo_async",
            "steps=3",
            "warmup=1",
            "threads=2",
            "overrides=[" + ",".join(f"'{o}'" for o in overrides) + "]",
            f"out={out}",
        ]
    )
    saved = json.loads(out.read_text())
    rows = saved["rows"]
    assert set(rows) == {"sync", "async1"}
    assert {r["steps_timed"] for r in rows.values()} == {2}
    assert rows["sync"]["trainer_threads"] == 2 and rows["async1"]["trainer_threads"] == 1
    assert 0 < rows["sync"]["trainer_idle_frac"] < 1  # the synchronous trainer samples
    assert report["async1_speedup"] > 0


def test_grpo_async_benchmark_refuses_bad_options():
    with pytest.raises(ValueError, match="modes: unknown"):
        main(["grpo_async", "modes=[sync,fast]"])
    with pytest.raises(ValueError, match="generator_threads"):
        main(["grpo_async", "threads=2", "generator_threads=3"])
