"""`python -m astrai.train.twin`: twins with common random numbers. Identical arms differ by
exactly nothing at every step, for every strategy; a known effect (a higher learning rate)
gets a paired interval narrower than the unpaired one of two independent runs; bad
treatments are refused before anything trains."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path

import numpy as np
import pytest
from grpo_helpers import TINY_GRPO_CLI
from test_distill import TEACHER, distill_args
from test_ppo_resume import PPO
from test_preference_resume import CASES, COMMON, unpaired_files
from test_replay import PRETRAIN
from train_helpers import REPO, TINY_MODEL

from astrai.train.twin import TwinError, twin
from astrai.train.twin_stats import block_length, paired_effect, unpaired_effect

pytestmark = pytest.mark.slow

HERE = Path(__file__).resolve().parent
QUIET = ["callbacks.progress_bar=null", "trainer.enable_model_summary=false"]
SFT = [
    "+experiment=tiny_sft",
    *TINY_MODEL,
    "tokenizer.train.max_bytes=400000",
    "data.train.prepare.builtin.n=64",
    "data.val.prepare.builtin.n=8",
    "data.batch_size=8",
    "trainer.limit_val_batches=0",
    "callbacks=default",
    *QUIET,
]


def inline_arms(arms: Mapping[str, list[str]], out: Path, parallel: bool) -> None:
    """The arms one after the other in this process (the tests' cheap runner)."""
    from astrai.train.runner import compose, train

    for overrides in arms.values():
        (run_dir,) = [o.split("=", 1)[1] for o in overrides if o.startswith("hydra.run.dir=")]
        rest = [o for o in overrides if not o.startswith("hydra.run.dir=")]
        train(compose([*rest, f"paths.output_dir={run_dir}"]))


def dirs(tmp: Path, data_dir: Path) -> list[str]:
    return [f"paths.data_dir={data_dir}", f"paths.log_dir={tmp}"]


def strategies(reference_run) -> dict[str, list[str]]:
    steps = "trainer.max_steps=2"
    pref = [o for o in COMMON if not o.startswith(("trainer.max_steps", "trainer.val_check"))]
    out = {
        "pretrain": PRETRAIN,
        "sft": SFT,
        "grpo": [*TINY_GRPO_CLI, "data.batch_size=2", "strategy.num_iterations=1"],
        "ppo": [*PPO, "strategy.num_iterations=1"],
        "distill": distill_args(reference_run("distill-teacher", TEACHER) / "export"),
    }
    for case in ("simpo", "cpo", "orpo", "reward", "kto"):
        out[case] = [*pref, "trainer.limit_val_batches=0", *CASES[case]]
    out["dpo"] = [*pref, "trainer.limit_val_batches=0", *CASES["dpo_losses"]]
    return {k: [*v, steps] for k, v in out.items()}


def test_identical_twins_differ_by_nothing_for_every_strategy(reference_run, tmp_path, data_dir):
    for name, args in strategies(reference_run).items():
        if name == "kto":
            args = [*args, *unpaired_files(tmp_path)]
        out = tmp_path / name
        result = twin(
            [*args, *dirs(tmp_path, data_dir)], "{}", out=out, compare=False, runner=inline_arms
        )
        assert "ledger/loss" in result.metrics, name
        for metric, m in result.metrics.items():
            assert all(d == 0 for d in m["diff"]), f"{name}: {metric} {m['diff']}"
            assert (m["effect"]["low"], m["effect"]["high"]) == (0.0, 0.0), f"{name}: {metric}"
        assert result.coupling["same_start"] and result.coupling["first_decoupled_step"] is None
        assert len(result.metrics["ledger/loss"]["steps"]) == 2, name


def test_a_known_effect_is_narrower_paired(tmp_path, data_dir):
    """lr 1e-3 against 3e-3 on tiny SFT, 24 steps: the twins (seed 0) against two independent
    runs (control seed 0, treatment seed 1): the paired interval is strictly narrower."""
    base = [
        *SFT,
        "trainer.max_steps=24",
        "optim.schedule.warmup_steps=2",
        *dirs(tmp_path, data_dir),
    ]
    paired = twin(
        [*base, "optim.lr=1e-3"],
        "{optim.lr: 3e-3}",
        out=tmp_path / "twin",
        compare=False,
        runner=inline_arms,
    )
    other = twin(
        [*base, "optim.lr=3e-3", "seed=1"],
        "{}",
        out=tmp_path / "seed1",
        compare=False,
        runner=inline_arms,
    )
    m = paired.metrics["ledger/loss"]
    control, treatment = m["control"], m["treatment"]
    independent = other.metrics["ledger/loss"]["control"]
    assert paired.coupling["first_decoupled_step"] is None  # the same samples, the same streams
    p = paired_effect(control, treatment)
    u = unpaired_effect(control, independent)
    assert p.mean < 0 and p.high < 0  # the higher rate lowers the loss
    assert p.width < u.width, (p, u)
    assert p == paired.effect("ledger/loss")
    # the unpaired mean is plain numpy's
    assert u.mean == pytest.approx(np.mean(independent) - np.mean(control), abs=1e-12)


def test_block_bootstrap_against_numpy():
    """The paired interval: moving blocks of n^(1/3) steps, 10,000 resamples, seed 0,
    percentile 95%: recomputed here with numpy alone."""
    rng = np.random.default_rng(3)
    c, t = rng.normal(size=27), rng.normal(size=27) + 0.5
    d = t - c
    b = block_length(27)
    assert b == 3
    gen = np.random.default_rng(0)
    starts = gen.integers(0, 27 - b + 1, size=(10_000, 9))
    means = np.array([np.concatenate([d[s : s + b] for s in row]).mean() for row in starts])
    low, high = np.percentile(means, [2.5, 97.5])
    e = paired_effect(c, t)
    assert (e.low, e.high) == pytest.approx((low, high), abs=1e-12)
    assert e.mean == pytest.approx(d.mean(), abs=1e-12)


def test_bad_treatments_are_refused_before_training(tmp_path, data_dir):
    args = [*SFT, "trainer.max_steps=2", *dirs(tmp_path, data_dir)]
    with pytest.raises(TwinError, match=r"optim\.lrr is not a key"):
        twin(args, "{optim.lrr: 1e-3}", out=tmp_path / "a", runner=inline_arms)
    with pytest.raises(TwinError, match="seed is what couples the arms"):
        twin(args, "{seed: 3}", out=tmp_path / "b", runner=inline_arms)
    with pytest.raises(TwinError, match="give a mapping"):
        twin(args, "[1, 2]", out=tmp_path / "c", runner=inline_arms)
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


def test_the_command_line_runs_both_arms_and_compares(tmp_path, data_dir):
    out = tmp_path / "cli"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "astrai.train.twin",
            *SFT,
            "trainer.max_steps=2",
            *dirs(tmp_path, data_dir),
            "treatment={optim.lr: 2e-3}",
            f"out={out}",
            "eval=[arithmetic]",
            "suites.arithmetic.num_prompts=4",
        ],
        cwd=REPO,
        env={**os.environ, "WANDB_MODE": "offline", "PYTHONPATH": str(HERE)},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    data = json.loads((out / "twin.json").read_text())
    assert data["treatment"] == {"optim.lr": 2e-3}
    assert data["metrics"]["ledger/lr"]["diff"][-1] != 0
    assert (out / "twin.md").is_file() and (out / "compare.json").is_file()
    assert "arithmetic" in json.loads((out / "compare.json").read_text())["suites"]
