"""`hardware=cpu_smoke`: any *_1b recipe runs its code path on a CPU at test size
(conf/hardware/cpu_smoke.yaml and conf/hardware/strategy/)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from omegaconf import OmegaConf
from train_helpers import cli, final_state, run_dirs

from astrai.train import preflight
from astrai.train.runner import compose

RECIPES = {  # experiment: (model preset, built-in data that stands in for the user's files)
    "pretrain_1b": ("astrai-1b", "builtin:stdlib/train"),
    "pretrain_1b_moe": ("astrai-1b-moe", "builtin:stdlib/train"),
    "sft_1b": ("astrai-1b", "builtin:arithmetic/sft/train"),
    "dpo_1b": ("astrai-1b", "builtin:arithmetic/preference/train"),
    "grpo_1b": ("astrai-1b", "builtin:arithmetic/prompt/train"),
}


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_cpu_smoke_wins_over_the_recipes_gpu_settings(name: str) -> None:
    gpu = compose([f"experiment={name}"])
    cfg = compose([f"experiment={name}", "hardware=cpu_smoke"])
    preset, source = RECIPES[name]
    assert gpu.trainer.accelerator == "gpu" and gpu.trainer.devices == 8
    assert cfg.trainer.accelerator == "cpu" and cfg.trainer.devices == 1
    assert cfg.trainer.strategy == "auto" and cfg.trainer.max_steps == 2
    assert cfg.model._target_ == "astrai.model.preset_model" and cfg.model.name == preset
    assert cfg.model.hidden_size == 64 and cfg.model.vocab_size == 512
    assert cfg.data.train.source == source
    assert list(cfg.logger) == ["csv"] and cfg.paths.log_dir.endswith("outputs/cpu_smoke")
    # the recipe's own training settings stay
    assert cfg.optim.lr == gpu.optim.lr and cfg.strategy._target_ == gpu.strategy._target_
    assert preflight.problems(cfg) == []


def test_without_cpu_smoke_nothing_changes() -> None:
    cfg = OmegaConf.to_container(compose(["experiment=tiny_sft"]), resolve=False)
    cfg.pop("hydra")
    assert "hardware" not in json.dumps(cfg)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["sft_1b"])
def test_a_1b_recipe_runs_two_steps_on_cpu(tmp_path: Path, data_dir: Path, name: str) -> None:
    cli([f"experiment={name}", "hardware=cpu_smoke", *run_dirs(tmp_path, data_dir)])
    run = tmp_path / "run"
    final_state(run, steps=2)  # last.ckpt at global step 2
    config = json.loads((run / "export" / "config.json").read_text())
    # the astrai-1b family (its RoPE base, tied embeddings) at test size
    assert config["rope_theta"] == 500000.0 and config["tie_word_embeddings"] is True
    assert config["hidden_size"] == 64 and config["num_hidden_layers"] == 2
