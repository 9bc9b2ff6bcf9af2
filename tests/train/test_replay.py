"""The step ledger and `python -m astrai.train.replay` (docs/exact-science.md): a step re-run
from the checkpoint before it reproduces the logged loss and gradient norm exactly and the
step's weights bit for bit; a changed ledger or changed data is caught."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import h5py
import pytest
import torch
from grpo_helpers import TINY_GRPO_CLI
from train_helpers import REPO, SMALL, TINY_MODEL, cli, run_dirs

pytestmark = pytest.mark.slow

HERE = Path(__file__).resolve().parent
ENV = {"PYTHONPATH": str(HERE)}  # _callbacks (KillAtStep) and _rewards
PRETRAIN = [
    *TINY_MODEL,
    *SMALL,
    "ledger=true",
    "callbacks.progress_bar=null",
    "trainer.enable_model_summary=false",
    "trainer.max_steps=4",
    "trainer.limit_val_batches=1",
    "trainer.val_check_interval=2",
    "data.batch_size=8",
    # LoRA dropout draws from the global RNG at every step: the replay must restore the streams
    "strategy.lora={r: 4, lora_alpha: 8, lora_dropout: 0.2}",
    "callbacks.model_checkpoint.every_n_train_steps=1",
    "callbacks.model_checkpoint.save_top_k=-1",
]


def replay(run: Path, *args: str, out: Path | None = None) -> subprocess.CompletedProcess:
    extra = [f"out={out}"] if out is not None else []
    return subprocess.run(
        [sys.executable, "-m", "astrai.train.replay", str(run), *args, *extra],
        cwd=REPO,
        env={**os.environ, "WANDB_MODE": "offline", **ENV},
        capture_output=True,
        text=True,
        timeout=300,
    )


def checkpoint_digest(path: Path) -> str:
    """BLAKE2b-128 of a checkpoint's weights, written here from the ledger's documented
    definition (name, dtype, shape, raw bytes of each state_dict entry, in order)."""
    state = torch.load(path, map_location="cpu", weights_only=False)["state_dict"]
    h = hashlib.blake2b(digest_size=16)
    for name, t in state.items():
        h.update(f"{name}:{t.dtype}:{tuple(t.shape)};".encode())
        h.update(t.contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def ledger_row(run: Path, step: int) -> dict:
    with h5py.File(run / "ledger.h5") as f:
        steps = list(f["steps/step"][:])
        i = steps.index(step)
        return {
            "loss": float(f["steps/loss"][i]),
            "grad_norm": float(f["steps/grad_norm"][i]),
            "weights_digest": f["steps/weights_digest"][i].decode(),
        }


@pytest.fixture(scope="module")
def pretrain_run(reference_run) -> Path:
    return reference_run("ledger-pretrain", PRETRAIN)


def test_replay_of_a_step_reproduces_loss_grad_norm_and_weights(pretrain_run, tmp_path):
    out = tmp_path / "replay.json"
    proc = replay(pretrain_run, "step=3", out=out)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    checks = json.loads(out.read_text())
    assert [c["step"] for c in checks] == [3]  # from step000002.ckpt: step 3 alone
    check = checks[0]
    assert check["ok"], check
    recorded = ledger_row(pretrain_run, 3)
    assert check["replayed"]["loss"] == recorded["loss"]
    assert check["replayed"]["grad_norm"] == recorded["grad_norm"]
    # the ledger's digest is the step-3 checkpoint's weights, bit for bit
    step3 = checkpoint_digest(pretrain_run / "checkpoints" / "step000003.ckpt")
    assert check["replayed"]["weights_digest"] == recorded["weights_digest"] == step3
    assert "exact" in proc.stdout


def test_replay_from_the_start_and_a_range(pretrain_run, tmp_path):
    """Step 1 has no checkpoint before it: the run's seed rebuilds the start; `--until`
    replays a range, every step checked."""
    out = tmp_path / "replay.json"
    proc = replay(pretrain_run, "step=1", "--until", "2", out=out)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    checks = json.loads(out.read_text())
    assert [(c["step"], c["ok"]) for c in checks] == [(1, True), (2, True)]
    step2 = checkpoint_digest(pretrain_run / "checkpoints" / "step000002.ckpt")
    assert checks[1]["replayed"]["weights_digest"] == step2


def test_a_ledger_that_disagrees_is_reported(pretrain_run, tmp_path):
    """The checks can fail: a ledger whose step-3 loss was altered is reported, exit 1."""
    copy = tmp_path / "run"
    shutil.copytree(pretrain_run, copy)
    with h5py.File(copy / "ledger.h5", "a") as f:
        i = list(f["steps/step"][:]).index(3)
        f["steps/micro_loss"][i] += 1e-6
    proc = replay(copy, "step=3")
    assert proc.returncode == 1, proc.stdout + proc.stderr[-3000:]
    assert "DIFFERS: micro_loss" in proc.stdout


def test_replay_refuses_what_it_cannot_do(pretrain_run, tmp_path):
    proc = replay(pretrain_run, "step=9")
    assert proc.returncode != 0
    assert "steps [9] are not in the ledger (1..4)" in proc.stderr
    bare = tmp_path / "bare"
    shutil.copytree(pretrain_run, bare)
    (bare / "ledger.h5").unlink()
    proc = replay(bare, "step=2")
    assert proc.returncode != 0 and "train with ledger=true" in proc.stderr
    proc = replay(pretrain_run, "step=two")
    assert proc.returncode != 0 and "step=two is not a step" in proc.stderr


def test_a_ledger_whose_data_changed_is_refused(pretrain_run, tmp_path, data_dir):
    """A run over a prepared file; the file changes afterwards: the replay names it and runs
    no step."""
    with h5py.File(pretrain_run / "ledger.h5") as f:
        prepared = json.loads(f.attrs["data_fingerprint_json"])["train"][0]["file"]
    corpus = tmp_path / "train.h5"
    shutil.copy(prepared, corpus)
    where = tmp_path / "files"
    args = [*PRETRAIN, f"data.train.source={corpus}", "~data.train.prepare", "trainer.max_steps=2"]
    cli([*args, *run_dirs(where, data_dir)])
    with h5py.File(corpus, "a") as f:
        f["input_ids"][0] = (int(f["input_ids"][0]) + 1) % 500
    proc = replay(where / "run", "step=2")
    assert proc.returncode != 0
    assert "the data changed" in proc.stderr and f"data.train: {corpus}" in proc.stderr
    assert "step 2:" not in proc.stderr  # refused before any step ran


def test_a_resumed_run_keeps_one_row_per_step(tmp_path, data_dir):
    """Killed in step 4 with checkpoints every 2 steps: the ledger holds step 3, which the
    resumed run (from step 2) records again; one row per step, and step 4 replays exactly."""
    args = [
        *PRETRAIN,
        "callbacks.model_checkpoint.every_n_train_steps=2",
        *run_dirs(tmp_path, data_dir),
    ]
    killed = cli(
        [*args, "+callbacks.kill._target_=_callbacks.KillAtStep", "+callbacks.kill.step=3"],
        check=False,
        env=ENV,
    )
    assert killed.returncode == -9, killed.stderr[-3000:]
    run = tmp_path / "run"
    with h5py.File(run / "ledger.h5") as f:
        assert list(f["steps/step"][:]) == [1, 2, 3]
    cli([*args, "ckpt_path=last"], env=ENV)
    with h5py.File(run / "ledger.h5") as f:
        assert list(f["steps/step"][:]) == [1, 2, 3, 4]
    out = tmp_path / "replay.json"
    proc = replay(run, "step=4", out=out)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    assert [(c["step"], c["ok"]) for c in json.loads(out.read_text())] == [(3, True), (4, True)]
    final = checkpoint_digest(run / "checkpoints" / "last.ckpt")
    assert ledger_row(run, 4)["weights_digest"] == final


# ------------------------------------------------------------------ GRPO
GRPO = [
    *TINY_GRPO_CLI,
    "data.batch_size=2",
    "callbacks.model_checkpoint.every_n_train_steps=1",
    "callbacks.model_checkpoint.save_top_k=-1",
    "trainer.max_steps=3",
    "ledger=true",
]


def test_grpo_replay_takes_the_ledgers_rollouts(tmp_path, data_dir):
    """tiny_grpo (mu = 2): steps 2 and 3 re-run from step 1's checkpoint with the recorded
    rollouts reproduce the run; a recorded reward changed makes step 2 differ, so the replay
    trains on the ledger's rollouts, not on new samples."""
    cli([*GRPO, *run_dirs(tmp_path, data_dir)], env=ENV)
    run = tmp_path / "run"
    with h5py.File(run / "ledger.h5") as f:
        assert len(f["rollouts/seed"]) == 2  # batches of steps 1-2 and 3 (mu = 2)
        assert len(f["rollouts/completion_tokens"]) > 0
    out = tmp_path / "replay.json"
    proc = replay(run, "step=2", "--until", "3", out=out)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    checks = json.loads(out.read_text())
    assert [(c["step"], c["ok"]) for c in checks] == [(2, True), (3, True)]
    last = checkpoint_digest(run / "checkpoints" / "step000003.ckpt")
    assert checks[-1]["replayed"]["weights_digest"] == last

    copy = tmp_path / "altered"
    shutil.copytree(run, copy)
    with h5py.File(copy / "ledger.h5", "a") as f:
        rewards = f["rollouts/reward"][:]
        rewards[0] += 1.0
        f["rollouts/reward"][:] = rewards
    proc = replay(copy, "step=1")
    assert proc.returncode == 1, proc.stdout + proc.stderr[-3000:]
    assert "DIFFERS" in proc.stdout
