"""`python -m astrai.bench train_trl` end to end at a tiny size (the speed is not checked):
both sides train every workload for the same number of steps on the same tokens, their first
losses agree (same weights, same batch), and bad options are named."""

import json
import math

import pytest

pytest.importorskip("trl")

from astrai.bench.__main__ import main

TINY = [
    "steps=2",
    "warmup_steps=1",
    "repeats=1",
    "model.hidden_size=32",
    "model.intermediate_size=64",
    "model.num_hidden_layers=1",
    "model.num_attention_heads=2",
    "model.num_key_value_heads=1",
    "model.head_dim=16",
    "model.vocab_size=64",
    "sft.batch_size=2",
    "sft.seq_len=16",
    "sft.prompt_len=4",
    "dpo.batch_size=2",
    "dpo.prompt_len=4",
    "dpo.response_len=4",
    "grpo.prompts=2",
    "grpo.num_generations=2",
    "grpo.max_new_tokens=4",
    "grpo.prompt_len=3",
]


@pytest.mark.slow
def test_train_trl_benchmark_runs_both_sides_on_the_same_work(tmp_path):
    out = tmp_path / "report.json"
    report = main(["train_trl", *TINY, f"out={out}"])
    saved = json.loads(out.read_text())
    assert set(saved["workloads"]) == {"sft", "dpo", "grpo"}
    for name, w in saved["workloads"].items():
        a, t = w["astrai"], w["trl"]
        assert a["steps"] == t["steps"] == 2, name
        assert len(a["losses"]) == len(t["losses"]) == 3, name
        assert w["finite_losses"], name
        assert a["threads"] == t["threads"] == 1
        assert w["speedup"] > 0 and w["speedup_cpu_time"] > 0 and isinstance(w["met"], bool)
    # same weights and the same batch: the first step's loss is the same on both sides
    sft, dpo = saved["workloads"]["sft"], saved["workloads"]["dpo"]
    assert sft["first_loss"]["astrai"] == pytest.approx(sft["first_loss"]["trl"], rel=1e-4)
    assert dpo["first_loss"]["astrai"] == pytest.approx(math.log(2), rel=1e-4)
    assert dpo["first_loss"]["trl"] == pytest.approx(math.log(2), rel=1e-4)
    # GRPO: every step sampled 2 x 2 completions of exactly 4 tokens on both sides
    grpo = saved["workloads"]["grpo"]
    assert grpo["astrai"]["completion_tokens_per_step"] == [16] * 3
    assert grpo["trl"]["completion_tokens_per_step"] == [16] * 3
    profile = grpo["astrai"]["profile"]
    assert {"generation", "forward", "reference", "backward", "optimizer", "step"} <= set(profile)
    assert profile["generation"] > 0 and profile["step"] >= profile["generation"]
    assert report["workloads"]["grpo"]["target"] == 1.5


def test_train_trl_benchmark_refuses_bad_options():
    with pytest.raises(SystemExit, match="workloads"):
        main(["train_trl", "workloads=[sft,ppo]"])
    with pytest.raises(SystemExit, match="steps"):
        main(["train_trl", "steps=0"])
    with pytest.raises(SystemExit, match=r"grpo\.strategy\.num_generations"):
        main(["train_trl", "workloads=[grpo]", "grpo.strategy.num_generations=4"])
    with pytest.raises(SystemExit, match="unknown option"):
        main(["train_trl", "+speed=fast"])
