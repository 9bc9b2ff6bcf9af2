"""`bench engine speculative=...` (astrai/bench/speculative.py) on a tiny model with tiny
sizes: the report's structure, the same greedy outputs with speculation on and off, the
copier quoting its prompt, positive ratios; never timings."""

import importlib.util
import json

import pytest
import torch

from astrai.bench.__main__ import bench_config, main
from astrai.bench.engine import format_report
from astrai.bench.speculative import (
    CUE,
    WORKLOADS,
    ScriptedTransformer,
    copy_workload,
    spec_config,
    successor_table,
    targets,
)
from astrai.inference.speculative import SpeculativeConfig

TINY = [
    "model=tiny",
    "spec_batches=[1,2]",
    "spec_rounds=2",
    "prompt_min=6",
    "prompt_max=16",
    "output_min=6",
    "output_max=14",
]
RUN_KEYS = {"tokens", "seconds", "tokens_per_s", "steps", "itl_mean", "itl_p50", "itl_p99"}
RUN_KEYS |= {"gap_p50", "gap_p99"}
SPEC_KEYS = {"spec_num_drafts", "spec_draft_tokens", "spec_accepted_tokens"}
SPEC_KEYS |= {"spec_mean_accepted_length", "acceptance_rate"}


def test_the_option_composes_as_a_name_or_a_mapping():
    assert bench_config("engine")["speculative"] is None
    assert bench_config("engine", ["speculative=ngram"])["speculative"] == "ngram"
    cfg = bench_config("engine", ["speculative={method: ngram, num_speculative_tokens: 3}"])
    assert cfg["speculative"] == {"method": "ngram", "num_speculative_tokens": 3}
    assert spec_config("ngram") == SpeculativeConfig()
    assert spec_config(cfg["speculative"]).num_speculative_tokens == 3
    with pytest.raises(ValueError, match="unknown key"):
        spec_config({"method": "ngram", "k": 2})
    with pytest.raises(ValueError, match="method draft_model needs a model dir"):
        spec_config("draft_model")


def test_copy_prompts_hold_the_answer_the_copier_gives():
    cfg = {"output_min": 5, "output_max": 9, "prompt_min": 3, "prompt_max": 7}
    successor = successor_table(64, seed=0)
    assert sorted(successor[16:].tolist()) == list(range(16, 64))  # a permutation
    work, answers = copy_workload(cfg, 4, successor, seed=1)
    for (prompt, n), answer in zip(work, answers):
        assert len(answer) == n
        cue = prompt[-CUE:]
        passage = cue + answer
        assert any(prompt[i : i + len(passage)] == passage for i in range(len(prompt)))
        chain = [int(successor[t]) for t in passage[:-1]]
        assert chain == passage[1:]


def test_speculative_benchmark_reports_rows_with_identical_outputs(tmp_path):
    out = tmp_path / "spec.json"
    report = main(
        ["engine", "speculative={method: ngram, num_speculative_tokens: 3}", *TINY, f"out={out}"]
    )
    saved = json.loads(out.read_text())
    spec = saved["speculative"]
    assert spec["config"]["method"] == "ngram" and spec["config"]["num_speculative_tokens"] == 3
    rows = spec["rows"]
    assert [(r["workload"], r["batch"]) for r in rows] == [
        (w, b) for b in (1, 2) for w in WORKLOADS
    ]
    for r in rows:
        assert r["requests"] == 2 * r["batch"]
        assert r["identical"] is True  # greedy: the same tokens with speculation on and off
        assert set(r["off"]) == RUN_KEYS and set(r["on"]) == RUN_KEYS | SPEC_KEYS
        assert r["off"]["tokens"] == r["on"]["tokens"] > 0
        assert r["speedup"] > 0 and r["off"]["tokens_per_s"] > 0
        assert r["on"]["spec_num_drafts"] >= 0
    copy = [r for r in rows if r["workload"] == "copy"]
    # the copier quotes its prompt, and prompt lookup finds it: fewer steps, proposals kept
    assert all(r["quotes_prompt"] for r in copy)
    assert all(r["on"]["spec_accepted_tokens"] > 0 for r in copy)
    assert all(r["on"]["steps"] < r["off"]["steps"] for r in copy)
    assert all(r["on"]["spec_mean_accepted_length"] > 1.5 for r in copy)
    t = spec["targets"]
    assert t["copy_batch1_speedup"] == copy[0]["speedup"] > 0
    assert isinstance(t["copy_batch1_met"], bool) and isinstance(t["random_met"], bool)
    assert t["novel_min_speedup"] > 0
    text = format_report(report)
    assert "speculative ngram K=3" in text and "copy batch 1:" in text


def test_scripted_model_forces_the_script_after_the_forward():
    from astrai.model import preset_model

    torch.manual_seed(0)
    model = preset_model("tiny", device="cpu").eval()
    model.__class__ = ScriptedTransformer
    model.successor = successor_table(model.config.vocab_size, seed=0)
    calls = []

    def spy(input_ids, positions, kv_cache, max_position=None, indices=None):
        calls.append(len(indices))  # the layers' output at the sampling rows
        return torch.randn(len(indices), model.config.hidden_size)

    model.hidden_packed = spy
    ids = torch.tensor([20, 30, 40])
    for script in ("copy", "novel"):
        model.script = script
        with torch.inference_mode():
            logits = model.forward_packed(ids, torch.arange(3), _NoCache(), torch.tensor([2]))
        top = int(logits[0].argmax())
        if script == "copy":
            assert top == int(model.successor[40])
        assert 16 <= top < model.config.vocab_size
    assert calls == [1, 1]  # the model's forward ran each time, the lm_head after it


class _NoCache:
    """Stands in for the KV cache: the layers (`hidden_packed`) are stubbed here."""


def test_draft_model_runs_or_is_skipped_with_a_note(tmp_path):
    if importlib.util.find_spec("astrai.inference.draft") is None:
        report = main(["engine", "speculative={method: draft_model, model: /nowhere}", *TINY])
        spec = report["speculative"]
        assert spec["rows"] == [] and "draft.py" in spec["note"]
        assert spec["targets"]["copy_batch1_met"] is None
        assert spec["note"] in format_report(report)
        return
    from astrai.model import ModelConfig, Transformer, preset, save_pretrained

    torch.manual_seed(1)
    vocab = preset("tiny").vocab_size
    draft = Transformer(
        ModelConfig(
            vocab_size=vocab,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=1,
            max_position_embeddings=512,
        )
    )
    save_pretrained(draft, tmp_path / "draft")
    option = f"speculative={{method: draft_model, model: {tmp_path / 'draft'}}}"
    report = main(["engine", option, *TINY[:-1], "output_max=8", "spec_batches=[2]"])
    rows = report["speculative"]["rows"]
    assert report["speculative"]["config"]["method"] == "draft_model"
    assert [r["workload"] for r in rows] == list(WORKLOADS)
    assert all(r["identical"] and r["speedup"] > 0 for r in rows)
    assert all(r["on"]["spec_num_drafts"] > 0 for r in rows)  # the draft always proposes


def test_targets_read_the_rows():
    rows = [
        {"workload": "copy", "batch": 1, "speedup": 2.0},
        {"workload": "random", "batch": 1, "speedup": 1.1},
        {"workload": "random", "batch": 4, "speedup": 0.9},
        {"workload": "novel", "batch": 1, "speedup": 0.97},
    ]
    t = targets(rows)
    assert t["copy_batch1_met"] is True and t["random_min_speedup"] == 0.9
    assert t["random_met"] is False and t["novel_met"] is True
    assert targets([])["copy_batch1_met"] is None
