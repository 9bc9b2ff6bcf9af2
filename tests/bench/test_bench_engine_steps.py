"""Per-step decode time of `bench engine` (astrai/bench/engine_steps.py): fields and their
consistency, a pool too small for the batch, and the report's table; never timings."""

import pytest
import torch

from astrai.bench.__main__ import main
from astrai.bench.common import bench_tokenizer
from astrai.bench.engine_matrix import format_matrix
from astrai.bench.engine_steps import (
    PHASES,
    PREFILL_KEYS,
    decode_steps,
    format_steps,
    run_steps,
)
from astrai.inference import InferenceEngine
from astrai.model import preset_model

FIELDS = {"batch", "step_ms", "tokens_per_s", "overhead_ms", "overhead_share"}
FIELDS |= {f"{p}_ms" for p in PHASES}
FIELDS |= {"step_gflop", "gflops", "matmul_gflops_roofline", "roofline_fraction", "peak_gflops"}
FIELDS |= set(PREFILL_KEYS)


@pytest.fixture(scope="module")
def tiny():
    torch.manual_seed(0)
    model = preset_model("tiny", device="cpu").eval()
    return model, bench_tokenizer(model.config.vocab_size)


class CountingEngine(InferenceEngine):
    """An engine that records its keywords and the plans its scheduler hands out."""

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self.kw = kw
        self.plans = []
        schedule = self.scheduler.schedule

        def recording():
            plans = schedule()
            self.plans.append([(len(p.rows), p.decode_only) for p in plans])
            return plans

        self.scheduler.schedule = recording


def test_decode_steps_reports_every_phase_per_batch(tiny):
    model, tokenizer = tiny
    made = []

    def factory(*args, **kw):
        made.append(CountingEngine(*args, **kw))
        return made[-1]

    report = decode_steps(
        factory, model, tokenizer, [1, 3], 4, repeats=2, warmup=1, decode_graphs=False
    )
    assert (report["timed_steps"], report["repeats"], report["prompt_len"]) == (4, 2, 32)
    # one engine per batch size and repeat, sized for the largest batch, loop thread off
    assert [e.kw["max_batch_size"] for e in made] == [3] * 4
    assert all(e.kw["start"] is False for e in made)
    # the timed steps (the last 4 of each engine) were one decode plan of the whole batch
    assert [e.plans[-4:] for e in made] == [[[(b, True)]] * 4 for b in (1, 3, 1, 3)]
    assert [b["batch"] for b in report["batches"]] == [1, 3]
    for entry in report["batches"]:
        assert set(entry) == FIELDS
        batch, step = entry["batch"], entry["step_ms"]
        assert all(entry[f"{p}_ms"] > 0 for p in PHASES) and step > 0
        phases = sum(entry[f"{p}_ms"] for p in PHASES)
        assert phases <= step * 1.001 + 1e-3  # the hand-off and clock reads are outside
        assert entry["tokens_per_s"] == pytest.approx(batch / step * 1e3)
        assert entry["overhead_ms"] == pytest.approx(step - entry["forward_ms"])
        assert entry["overhead_share"] == pytest.approx(entry["overhead_ms"] / step)


def test_timed_steps_are_pure_decode_of_the_whole_batch(tiny):
    model, tokenizer = tiny
    engines = []

    def factory(*args, **kw):
        engines.append(CountingEngine(*args, **kw))
        return engines[-1]

    decode_steps(factory, model, tokenizer, [2], 5, warmup=2, decode_graphs=False)
    (plans,) = [e.plans for e in engines]
    assert plans[0] == [(2, False)]  # both prompts prefilled in one step, each sampling
    assert plans[-5:] == [[(2, True)]] * 5  # the timed steps: one decode plan of 2 rows
    assert len(plans) == 1 + 2 + 5  # prefill, warm-up, timed


def test_a_pool_too_small_for_the_batch_is_named(tiny):
    model, tokenizer = tiny
    # 128 KV tokens hold one 48-token request for its whole run, not three prompts at once.
    small = dict(cache_mode="paged", page_size=4, kv_tokens=128, decode_graphs=False)
    ok = decode_steps(InferenceEngine, model, tokenizer, [1], 2, prompt_len=48, **small)
    assert ok["batches"][0]["batch"] == 1
    with pytest.raises(RuntimeError, match=r"batch 3: .*KV pool too small"):
        decode_steps(InferenceEngine, model, tokenizer, [1, 3], 2, prompt_len=48, **small)
    with pytest.raises(ValueError, match="batches must be positive"):
        decode_steps(InferenceEngine, model, tokenizer, [0], 2)


def test_table_lines():
    def entry(batch, ms, share):
        return {"batch": batch, "step_ms": ms, "tokens_per_s": batch / ms * 1e3,
                "overhead_share": share}  # fmt: skip

    report = {"prompt_len": 32, "timed_steps": 50, "batches": [entry(1, 2.0, 0.5)]}
    report["batches"].append(entry(48, 4.0, 0.25))
    lines = format_steps([("m", report), ("skipped", None)], label="row")
    assert lines[3] == "| row | step ms @1 | step ms @48 | tok/s @48 | non-forward share @1 | @48 |"
    assert lines[-1] == "| m | 2.00 | 4.00 | 12000 | 50% | 25% |"
    assert format_steps([("m", None)]) == []


@pytest.mark.slow
def test_matrix_run_reports_and_prints_the_steps(capsys):
    report = main(
        [
            "engine",
            "matrix=tiny",
            "matrix_rows=[tiny-d16-g2]",
            "skip_hf=true",
            "prefix_overhead=false",
            "prompt_min=4",
            "prompt_max=8",
            "output_min=2",
            "output_max=4",
            "threads=1",
            "step_batches=[1,2]",
            "step_count=3",
        ]
    )
    (row,) = report["rows"]
    steps = row["steps"]
    assert steps["timed_steps"] == 3 and [b["batch"] for b in steps["batches"]] == [1, 2]
    out = capsys.readouterr().out
    assert "| row | step ms @1 | step ms @2 | tok/s @2 | non-forward share @1 | @2 |" in out
    line = next(x for x in out.splitlines() if x.startswith("| tiny-d16-g2 | ")
                and x.count("|") == 7)  # fmt: skip
    assert line.split(" | ")[1] == f"{steps['batches'][0]['step_ms']:.2f}"
    # the FLOP-rate table follows, one line per batch size, and ends the report
    rates = [x for x in out.splitlines() if x.startswith("| tiny-d16-g2 | ") and x.count("|") == 11]
    assert [x.split(" | ")[1] for x in rates] == ["1", "2"]
    assert f"| {steps['batches'][1]['roofline_fraction']:.0%} |" in rates[1]
    text = format_matrix(report)
    assert line in text.splitlines() and text.endswith(rates[1])
    for skipped in ([], None):  # step_batches=[] or null: nothing runs
        assert run_steps({"step_batches": skipped}, None, None, None) is None
