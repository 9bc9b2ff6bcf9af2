"""The engine and serve benchmarks run end to end on a tiny workload (figures are not checked
here); `python -m astrai.bench` composes each benchmark's options with Hydra."""

import json
import re
import shlex
from pathlib import Path

import pytest

from astrai.bench.__main__ import bench_config, main
from astrai.cli_keys import command_line

ROOT = Path(__file__).resolve().parents[2]


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
            "hf_batch_sizes=[1,all]",
            "prefix_requests=3",
            "prefix_len=64",
            "engine.page_size=4",  # pages the 4-12 token prompts fill, for the radix tree
            f"out={out}",
        ]
    )
    saved = json.loads(out.read_text())
    assert saved["astrai"]["tokens"] == report["astrai"]["tokens"] > 0
    # Both systems produced exactly the requested (useful) tokens.
    assert {r["tokens"] for r in saved["transformers"].values()} == {saved["astrai"]["tokens"]}
    assert saved["prefix"]["ttft_ratio"] > 0
    # Prefill and decode speeds, and the radix cache's cost at 0% hits (engine_phases.py).
    phases, tokens = saved["phases"], saved["astrai"]["tokens"]
    assert saved["sync"]["tokens"] == tokens and phases["decode_tokens"] == tokens - 3
    assert phases["prefill_tokens"] == saved["sync"]["prompt_tokens"] > 0
    assert phases["prefill_tokens_per_s"] > 0 and phases["decode_tokens_per_s"] > 0
    over = saved["prefix_overhead"]
    assert over["radix"]["tokens"] == over["no_cache"]["tokens"] == tokens
    assert over["radix_hit_rate"] == 0.0 and over["radix"]["prefix_indexed_tokens"] > 0
    assert over["no_cache"]["prefix_indexed_tokens"] is None


def test_unknown_option_is_refused():
    with pytest.raises(SystemExit, match="requestz"):
        main(["engine", "requestz=3"])
    with pytest.raises(SystemExit, match="unknown option 'requestz'"):
        main(["engine", "+requestz=3"])
    with pytest.raises(SystemExit, match="unknown benchmark 'engin'"):
        main(["engin"])


def test_engine_benchmark_takes_the_model_and_engine_groups():
    cfg = bench_config("engine")
    assert cfg["model"] == {  # conf/model/astrai-30m.yaml, as training composes it
        "_target_": "astrai.model.preset_model",
        "_partial_": True,
        "name": "astrai-30m",
    }
    assert cfg["engine"]["_target_"] == "astrai.inference.InferenceEngine"
    assert cfg["engine"]["page_size"] == 16 and cfg["engine"]["kv_tokens"] is None  # conf/engine
    assert (cfg["engine"]["cache_mode"], cfg["engine"]["max_batch_size"]) == ("contiguous", 64)
    cfg = bench_config(
        "engine", ["engine=paged", "engine.max_batch_size=256", "engine.page_size=32"]
    )
    assert (cfg["engine"]["cache_mode"], cfg["engine"]["max_batch_size"]) == ("paged", 256)
    assert cfg["engine"]["page_size"] == 32
    assert bench_config("serve", ["engine=paged"])["engine"]["cache_mode"] == "paged"
    assert bench_config("engine", ["model=tiny"])["model"]["name"] == "tiny"


def _recorded_commands():
    """Every `python -m astrai.bench ...` command in the Makefile, experiments/, README and docs."""
    texts = [(ROOT / "Makefile").read_text().replace("\\\n", " ")]
    texts += [(ROOT / p).read_text() for p in ("experiments/README.md", "README.md")]
    texts += [p.read_text() for p in sorted((ROOT / "docs").glob("*.md"))]
    texts += [p.read_text() for p in sorted((ROOT / "experiments" / "bench").glob("*.md"))]
    found = []
    for text in texts:
        text = re.sub(r"\s+", " ", text)
        for m in re.finditer(r"-m astrai\.bench ([a-z_]+(?: [a-z_+.]+=[^ `]+)*)", text):
            found.append(shlex.split(m.group(1)))
    return found


def test_recorded_commands_still_compose():
    commands = _recorded_commands()
    assert len(commands) >= 5 and ["kernels", "out=experiments/bench/kernels-gpu.json"] in commands
    for name, *overrides in commands:
        # every recorded option still exists, typed as before (as the command line reads it:
        # model_path=<dir> is model=pretrained model.path=<dir>)
        bench_config(name, command_line("bench", overrides))
    gpu = next(c for c in commands if "model=qwen3-0.6b" in c)
    cfg = bench_config(gpu[0], gpu[1:])
    assert cfg["model"]["name"] == "qwen3-0.6b" and cfg["engine"]["cache_mode"] == "paged"
    assert cfg["hf_batch_sizes"] == "all" and cfg["engine"]["max_batch_size"] == 256


def test_values_are_typed_by_the_defaults():
    cfg = bench_config("engine", ["device=123", "repeats=2", "skip_hf=true"])
    assert cfg["device"] == "123" and cfg["repeats"] == 2 and cfg["skip_hf"] is True
    with pytest.raises(SystemExit, match="expected int"):
        bench_config("engine", ["requests=many"])


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


def test_a_batch_size_listed_twice_keeps_its_best_run():
    """With 8 requests `hf_batch_sizes=[1,8,all]` lists 8 twice: the report keeps the faster
    of its runs (the ratio divides by the best transformers run), not the later one."""
    from astrai.bench.engine_hf import best_per_size

    speeds = iter([10.0, 50.0, 20.0])  # bs=1, then bs=8 (fast), then bs=8 again (slow)
    out = best_per_size([1, 8, 8], lambda bs: {"bs": bs, "tokens_per_s": next(speeds)}, 1)
    assert out == {"bs=1": {"bs": 1, "tokens_per_s": 10.0}, "bs=8": {"bs": 8, "tokens_per_s": 50.0}}


def test_engine_benchmark_runs_batch_invariant(tmp_path):
    """`engine.batch_invariant=true`: the mode refuses the radix cache, so the shared-prefix
    comparison runs without it and the report says no ratio."""
    report = main(
        [
            "engine",
            "model=tiny",
            "requests=3",
            "prompt_min=4",
            "prompt_max=12",
            "output_min=2",
            "output_max=5",
            "peers=[]",
            "prefix_overhead=false",
            "step_batches=[]",
            "prefix_requests=2",
            "prefix_len=32",
            "engine.batch_invariant=true",
            f"out={tmp_path / 'engine.json'}",
        ]
    )
    assert report["astrai"]["tokens"] > 0 and report["phases"]["decode_tokens_per_s"] > 0
    assert set(report["prefix"]) == {"no_cache"}
