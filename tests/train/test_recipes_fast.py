"""The reference recipes chained as their READMEs run them, each 3 steps with ``debug=fast``:
tiny_sft_start writes the export that tiny_dpo samples its on-policy pairs from and that
tiny_grpo starts from (``${paths.log_dir}/tiny_sft_start/latest/export``)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from train_helpers import cli, run_dirs

from astrai.train.logs import read_metrics

pytestmark = pytest.mark.slow

QUIET = ["callbacks.progress_bar=null", "trainer.enable_model_summary=false"]
SMALL_TOKENIZER = "tokenizer.train.max_bytes=400000"  # shared with the other CLI tests' cache
# every recipe: debug=fast, the shared tokenizer, a 4-prompt evaluation, no progress output
FAST = [
    "debug=fast",
    SMALL_TOKENIZER,
    "callbacks.eval.suites.arithmetic.num_prompts=4",
    "callbacks.eval.suites.arithmetic.max_tokens=8",
    *QUIET,
]


def _dirs(tmp: Path, data_dir: Path, run: str) -> list[str]:
    dirs = run_dirs(tmp, data_dir)
    return [d.replace(f"={tmp / 'run'}", f"={tmp / run}") for d in dirs]


@pytest.fixture(scope="module")
def sft_start(shared_build, data_dir: Path) -> Path:
    """The outputs folder of one `experiment=tiny_sft_start` run, trained once per session;
    each chain copies it as its own `outputs` (a copy, not links: its recipes sample from an
    export of their own, as when they trained the start themselves)."""

    def build(where: Path) -> None:
        cli(
            [
                "experiment=tiny_sft_start",
                *FAST,
                "data.train.prepare.builtin.n=64",
                "data.val.prepare.builtin.n=16",
                *_dirs(where, data_dir, "sft"),
            ]
        )

    return shared_build("recipes-sft-start", build) / "outputs"


def test_sft_start_then_dpo_and_grpo_from_it(
    tmp_path: Path, data_dir: Path, sft_start: Path
) -> None:
    shutil.copytree(sft_start, tmp_path / "outputs")
    start = tmp_path / "outputs" / "tiny_sft_start" / "latest" / "export"
    assert (start / "model.safetensors").is_file()

    # 3 steps of SFT are never right: the worked solution stands in as chosen (fallback)
    pairs = [
        f"data.{split}.source.{key}"
        for split in ("train", "val")
        for key in ("builtin.n=8", "num_samples=2", "max_tokens=8", "fallback=reference")
    ]
    cli(
        [
            "experiment=tiny_dpo",
            *FAST,
            *pairs,
            "data.batch_size=2",
            *_dirs(tmp_path, data_dir, "dpo"),
        ]
    )
    dpo = tmp_path / "dpo"
    assert (dpo / "export" / "model.safetensors").is_file()
    keys = set(read_metrics(dpo))
    for key in (
        "train/loss",
        "train/rewards/accuracy",
        "val/rewards/accuracy",
        "eval/arithmetic/exact_match",
    ):
        assert key in keys, key
    config = json.loads((dpo / "export" / "training_state.json").read_text())
    assert config["global_step"] == 3

    cli(
        [
            "experiment=tiny_grpo",
            *FAST,
            "data.train.prepare.builtin.n=32",
            "data.batch_size=2",
            "strategy.num_generations=4",
            "strategy.max_new_tokens=8",
            *_dirs(tmp_path, data_dir, "grpo"),
        ]
    )
    grpo = tmp_path / "grpo"
    assert (grpo / "export" / "model.safetensors").is_file()
    keys = set(read_metrics(grpo))
    for key in (
        "train/loss",
        "train/reward_mean",
        "train/zero_var_frac",
        "eval/arithmetic/exact_match",
    ):
        assert key in keys, key


def test_dpo_without_its_starting_policy_fails_before_training(
    tmp_path: Path, data_dir: Path
) -> None:
    proc = cli(
        [
            "experiment=tiny_dpo",
            "debug=fast",
            SMALL_TOKENIZER,
            *QUIET,
            *_dirs(tmp_path, data_dir, "x"),
        ],
        check=False,
    )
    assert proc.returncode != 0
    out = proc.stdout + proc.stderr
    assert "tiny_sft_start" in out and "does not exist" in out
    assert not (tmp_path / "x" / "checkpoints").exists()


def test_sft_start_then_the_preference_recipes(
    tmp_path: Path, data_dir: Path, sft_start: Path
) -> None:
    """tiny_simpo (pairs), tiny_kto (unpaired on-policy answers), tiny_reward and
    tiny_grpo_learned (GRPO scored by tiny_reward's export) chained from one start, as
    their READMEs run them."""
    shutil.copytree(sft_start, tmp_path / "outputs")
    sampled = [
        f"data.{split}.source.{key}"
        for split in ("train", "val")
        for key in ("builtin.n=8", "num_samples=2", "max_tokens=8")
    ]
    pairs = [*sampled, *(f"data.{s}.source.fallback=reference" for s in ("train", "val"))]
    runs = {
        "simpo": ["experiment=tiny_simpo", *pairs],
        "kto": ["experiment=tiny_kto", *sampled],
        "reward": ["experiment=tiny_reward", *pairs],
    }
    expected = {
        "simpo": ("train/rewards/accuracy", "val/rewards/accuracy", "eval/arithmetic/exact_match"),
        "kto": ("train/kl", "val/kl", "eval/arithmetic/exact_match"),
        "reward": ("train/accuracy", "val/accuracy"),
    }
    no_eval = [a for a in FAST if not a.startswith("callbacks.eval")]  # tiny_reward has none
    for name, args in runs.items():
        fast = no_eval if name == "reward" else FAST
        cli([*args, *fast, "data.batch_size=2", *_dirs(tmp_path, data_dir, name)])
        keys = set(read_metrics(tmp_path / name))
        assert set(expected[name]) <= keys, (name, sorted(keys))
    export = tmp_path / "reward" / "export"
    config = json.loads((export / "config.json").read_text())
    assert config["architectures"][0].endswith("ForSequenceClassification")
    assert (tmp_path / "outputs" / "tiny_reward" / "latest" / "export").is_dir()

    cli(
        [
            "experiment=tiny_grpo_learned",
            *FAST,
            "data.train.prepare.builtin.n=32",
            "data.batch_size=2",
            "strategy.num_generations=4",
            "strategy.max_new_tokens=8",
            *_dirs(tmp_path, data_dir, "grpo"),
        ]
    )
    keys = set(read_metrics(tmp_path / "grpo"))
    assert {"train/reward/learned", "train/reward_mean"} <= keys, sorted(keys)


# the Countdown recipes' own suite (their experiments drop the arithmetic one)
COUNTDOWN_FAST = [
    "debug=fast",
    SMALL_TOKENIZER,
    "callbacks.eval.suites.countdown.num_prompts=4",
    "callbacks.eval.suites.countdown.max_tokens=8",
    *QUIET,
]


def test_countdown_start_then_dapo_from_it(tmp_path: Path, data_dir: Path) -> None:
    """tiny_sft_countdown_start, then tiny_dapo from its export as the record runs them:
    dynamic sampling and the overlong penalty reach the metrics."""
    cli(
        [
            "experiment=tiny_sft_countdown_start",
            *COUNTDOWN_FAST,
            "data.train.prepare.builtin.n=64",  # the weak solver writes about half of them
            "data.val.prepare.builtin.n=16",
            "data.batch_size=4",
            *_dirs(tmp_path, data_dir, "start"),
        ]
    )
    start = tmp_path / "outputs" / "tiny_sft_countdown_start" / "latest" / "export"
    assert (start / "model.safetensors").is_file()
    cli(
        [
            "experiment=tiny_dapo",
            *COUNTDOWN_FAST,
            "data.train.prepare.builtin.n=32",
            "data.batch_size=2",
            "strategy.num_generations=4",
            "strategy.max_new_tokens=8",
            "strategy.overlong_penalty.len=2",
            *_dirs(tmp_path, data_dir, "dapo"),
        ]
    )
    keys = set(read_metrics(tmp_path / "dapo"))
    for key in (
        "train/dynamic_sampling/gen_batches",
        "train/dynamic_sampling/zero_var_frac_before",
        "train/reward/overlong",
        "train/reward/countdown",
        "eval/countdown/countdown",
    ):
        assert key in keys, (key, sorted(keys))
