"""strategy=ppo through ``python -m astrai.train``: killed anywhere (during the critic's
warm-up, between the two passes of a generation batch, after it) and resumed, the run ends
with the uninterrupted one's policy, critic and optimizer state bit for bit; and
``astrai.train.replay`` re-runs its recorded steps from the ledger's rollouts exactly (the
critic's weights are in the checked digest)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from train_helpers import REPO, TINY_MODEL, checkpoint_differences, cli, run_dirs

pytestmark = pytest.mark.slow

HERE = Path(__file__).resolve().parent
ENV = {"PYTHONPATH": str(HERE)}  # _callbacks (KillAtStep) and _rewards
STEPS = 4
PPO = [
    "+experiment=tiny_ppo",
    *TINY_MODEL,
    "tokenizer.train.max_bytes=400000",  # shared with the other CLI tests' cache
    "data.train.prepare.builtin.n=32",
    "data.batch_size=2",
    "strategy.init_from=null",
    "strategy.num_generations=2",
    "strategy.max_new_tokens=8",
    "strategy.num_iterations=2",  # steps 1-2 and 3-4 share a generation batch
    "strategy.lam=0.95",
    "strategy.critic.warmup_steps=2",
    "strategy.rewards=[{_target_: _rewards.length_mod3, _partial_: true}]",
    "callbacks=default",
    "callbacks.progress_bar=null",
    "trainer.enable_model_summary=false",
    "optim.lr=1e-2",
    "callbacks.model_checkpoint.every_n_train_steps=1",
    "callbacks.model_checkpoint.save_top_k=-1",
    f"trainer.max_steps={STEPS}",
    "ledger=true",
]


def _replay(run: Path, *args: str, out: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "astrai.train.replay", str(run), *args, f"out={out}"],
        cwd=REPO,
        env={**os.environ, "WANDB_MODE": "offline", "OMP_NUM_THREADS": "1", **ENV},
        capture_output=True,
        text=True,
        timeout=600,
    )


def test_ppo_killed_anywhere_resumes_and_replays_bit_exact(tmp_path, data_dir):
    cli([*PPO, *run_dirs(tmp_path / "ref", data_dir)], env=ENV)
    ref = tmp_path / "ref" / "run"
    step1 = torch.load(ref / "checkpoints" / "step000001.ckpt", weights_only=False)
    assert any(k.startswith("critic.") for k in step1["state_dict"])
    generation = step1["grpo_generation"]  # mid-reuse: the values and returns travel
    assert generation["values"] and generation["returns"]
    assert (ref / "export" / "critic" / "config.json").is_file()
    config = json.loads((ref / "export" / "critic" / "config.json").read_text())
    assert config["architectures"][0].endswith("ForTokenClassification")

    # killed in step 2 (the warm-up's, between a generation batch's passes), 3 (the policy's
    # first, a new generation batch) and 4 (between the passes)
    for step in (1, 2, 3):
        where = tmp_path / f"kill{step}"
        args = [*PPO, *run_dirs(where, data_dir)]
        kill = ["+callbacks.kill._target_=_callbacks.KillAtStep", f"+callbacks.kill.step={step}"]
        killed = cli([*args, *kill], check=False, env=ENV)
        assert killed.returncode == -9, killed.stderr[-3000:]
        cli([*args, "ckpt_path=last"], env=ENV)
        different = checkpoint_differences(ref, where / "run", STEPS)
        assert not different, f"killed in step {step + 1}: {different}"

    out = tmp_path / "replay.json"
    proc = _replay(ref, "step=2", "--until", str(STEPS), out=out)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    checks = json.loads(out.read_text())
    assert [(c["step"], c["ok"]) for c in checks] == [(s, True) for s in range(2, STEPS + 1)]


def test_two_ddp_ranks_train_the_critic_alone_in_its_warm_up(tmp_path, data_dir):
    """Under DDP (2 gloo ranks, unused parameters not allowed: trainer=ddp's default) the
    warm-up steps still compute the policy's loss (weighted 0) so every parameter gets a
    gradient; the policy's are then dropped: it does not move in steps 1-2, the critic does,
    and from step 3 both do."""
    run = tmp_path / "run"
    args = [
        *PPO,
        *run_dirs(tmp_path, data_dir),
        "trainer=ddp",
        "trainer.accelerator=cpu",
        "trainer.devices=2",
        "ledger=false",
        "trainer.max_steps=3",
    ]
    cli(args, env=ENV)
    states = [
        torch.load(run / "checkpoints" / f"step{s:06d}.ckpt", weights_only=False)["state_dict"]
        for s in (1, 2, 3)
    ]

    def moved(a: dict, b: dict, prefix: str) -> bool:
        return any(not torch.equal(a[k], b[k]) for k in a if k.startswith(prefix))

    assert not moved(states[0], states[1], "model.")
    assert moved(states[0], states[1], "critic.")
    assert moved(states[1], states[2], "model.") and moved(states[1], states[2], "critic.")
