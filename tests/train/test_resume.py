"""Kill-anywhere resume (`python -m astrai.train ... ckpt_path=last`), with randomness in the
step: LoRA dropout draws from the global torch RNG at every training step.

A run is SIGKILLed right after each of its checkpoints in turn (the kill lands in the next
optimizer step, before the weights change), including checkpoints written just before a
validation and at the end of an epoch, and once in the middle of a validation, and resumed
after each kill; the run must end with the uninterrupted run's weights and optimizer state,
bit for bit (one reference without loader
workers serves the runs with and without them). Before the fix, a checkpoint
followed by a validation or a new epoch resumed with a shifted random stream: creating the
validation or next-epoch DataLoader iterator drew its workers' base seed from the global RNG.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from train_helpers import SMALL, TINY_MODEL, checkpoint_differences, cli, final_state, run_dirs

pytestmark = pytest.mark.slow

HERE = Path(__file__).resolve().parent
KILL = {"PYTHONPATH": str(HERE)}  # the test-only KillAtStep callback
# 385 training windows: 96 a batch with drop_last is 4 batches an epoch, so the checkpoints of
# steps 4 and 8 end an epoch and precede a validation (val_check_interval=4).
RUN = [
    *TINY_MODEL,
    *SMALL,
    "callbacks.progress_bar=null",
    "trainer.enable_model_summary=false",
    "trainer.max_steps=10",
    "trainer.val_check_interval=4",
    "trainer.limit_val_batches=1",
    "callbacks.model_checkpoint.every_n_train_steps=2",
    "optim.schedule.warmup_steps=3",
    "data.batch_size=96",
    "data.drop_last=true",
    "strategy.lora={r: 4, lora_alpha: 8, lora_dropout: 0.2}",
]
# (callback, step): one run killed in turn right after each checkpoint (the kill lands in the
# next optimizer step) and in the middle of the validation that follows the checkpoint of step
# 4, resumed after each kill: each launch resumes the previous one's checkpoint, so every
# resume point is crossed once and any difference carries to the end (6 launches, not 10).
KILLS = [
    ("KillAtStep", 2),
    ("KillInValidation", 4),
    ("KillAtStep", 4),
    ("KillAtStep", 6),
    ("KillAtStep", 8),
]
# With loader workers, the kills where their prefetching could shift the data position: in
# the middle of an epoch, at its end (a new iterator follows) and inside the validation.
KILLS_WITH_WORKERS = [("KillAtStep", 2), ("KillInValidation", 4), ("KillAtStep", 4)]


@pytest.fixture(scope="module")
def reference(reference_run) -> Path:
    """The uninterrupted run every resumed one must equal, with no loader workers: a run
    with workers draws the same samples in the same order, so it must end there too
    (trained once per session)."""
    run = reference_run("resume", [*RUN, "data.num_workers=0"])
    assert any("lora" in k for k in final_state(run, 10)[0])
    return run


@pytest.mark.parametrize(("workers", "kills"), [(0, KILLS), (2, KILLS_WITH_WORKERS)])
def test_kill_after_every_checkpoint_resumes_bit_identical(
    reference, tmp_path, data_dir, workers, kills
):
    run = [*RUN, f"data.num_workers={workers}", *run_dirs(tmp_path, data_dir)]
    for n, (callback, step) in enumerate(kills):
        killed = cli(
            [
                *run,
                *(["ckpt_path=last"] if n else []),
                f"+callbacks.kill._target_=_callbacks.{callback}",
                f"+callbacks.kill.step={step}",
            ],
            check=False,
            env=KILL,
        )
        assert killed.returncode == -9, f"{callback}({step}): {killed.stderr[-3000:]}"
    cli([*run, "ckpt_path=last"])
    different = checkpoint_differences(reference, tmp_path / "run", 10)
    assert not different, f"workers={workers}, kills {kills}: {different}"


def test_a_cut_short_checkpoint_is_skipped_for_the_previous_good_one(reference, tmp_path, data_dir):
    """A checkpoint cut short while written (simulated by truncating `last.ckpt`) is never
    resumed from: the newest complete one is, with a log line naming both."""
    run = [*RUN, *run_dirs(tmp_path / "b", data_dir)]
    killed = cli(
        [*run, "+callbacks.kill._target_=_callbacks.KillAtStep", "+callbacks.kill.step=6"],
        check=False,
        env=KILL,
    )
    assert killed.returncode == -9, killed.stderr[-3000:]
    checkpoints = tmp_path / "b" / "run" / "checkpoints"
    last = checkpoints / "last.ckpt"
    last.write_bytes(last.read_bytes()[: last.stat().st_size // 2])
    resumed = cli([*run, "ckpt_path=last"])
    out = resumed.stdout + resumed.stderr
    assert f"checkpoint {last} is cut short" in out and "skipped" in out, out[-3000:]
    assert f"resuming from {checkpoints / 'step000006.ckpt'}" in out, out[-3000:]
    assert not checkpoint_differences(reference, tmp_path / "b" / "run", 10)


def test_a_run_extended_past_its_max_steps_continues_its_epoch(tmp_path, data_dir):
    """Stopped by max_steps=6 in the middle of the second epoch and resumed with
    max_steps=10 (a flat schedule, so the step count does not change the learning rates):
    Lightning counts the stopped epoch as ended, the data does not skip its rest, and the
    run ends with the uninterrupted 10-step run's weights and optimizer state, bit for bit."""
    flat = [*RUN, "optim/schedule=constant", "data.num_workers=0"]
    cli([*flat, *run_dirs(tmp_path / "straight", data_dir)])
    run = [*flat, *run_dirs(tmp_path / "extended", data_dir)]
    cli([*run, "trainer.max_steps=6"])
    cli([*run, "ckpt_path=last"])
    different = checkpoint_differences(
        tmp_path / "straight" / "run", tmp_path / "extended" / "run", 10
    )
    assert not different, different
