"""A run stopped by SIGTERM or SIGINT writes a checkpoint after the step it was in, exits with
128 + the signal's number, and `ckpt_path=last` resumes from there, not from the last periodic
checkpoint, ending bit-identical to an uninterrupted run (LoRA dropout draws from the global
RNG at every step, so a shifted random stream would show).

Periodic checkpoints are written every 5 steps and the runs stop after steps 6 and 7, so a
resume from the periodic one would also end identical: what shows the resume point is the
step of the checkpoint resumed from. Without `InterruptCheckpoint` the stop would leave only
`last.ckpt` of step 5; with it writing at the wrong point (mid-step, or validation's random
state), the resumed run's weights would differ.
"""

from __future__ import annotations

import signal
from pathlib import Path

import pytest
import torch
from train_helpers import SMALL, TINY_MODEL, checkpoint_differences, cli, run_dirs

pytestmark = pytest.mark.slow

HERE = Path(__file__).resolve().parent
TEST_CALLBACKS = {"PYTHONPATH": str(HERE)}  # the test-only SignalAtStep / NaNAtStep callbacks
# 385 training windows, 96 a batch with drop_last: 4 batches an epoch. Validation after steps
# 3, 6 and 9 (2 batches, so a stop can land between them), periodic checkpoints at 5 and 10.
RUN = [
    *TINY_MODEL,
    *SMALL,
    "callbacks.progress_bar=null",
    "trainer.enable_model_summary=false",
    "trainer.max_steps=10",
    "trainer.val_check_interval=3",
    "trainer.limit_val_batches=2",
    "callbacks.model_checkpoint.every_n_train_steps=5",
    "optim.schedule.warmup_steps=3",
    "data.batch_size=96",
    "data.drop_last=true",
    "strategy.lora={r: 4, lora_alpha: 8, lora_dropout: 0.2}",
]
# (signal, sent during optimizer step, or in the validation after step, checkpoint's step)
STOPS = [
    pytest.param("SIGTERM", "step=6", 7, id="sigterm-mid-step"),
    pytest.param("SIGINT", "step=6", 7, id="sigint-mid-step"),
    pytest.param("SIGTERM", "validation=6", 6, id="sigterm-mid-validation"),
]


def _load(path: Path) -> dict:
    return torch.load(path, map_location="cpu", weights_only=False)


@pytest.fixture(scope="module")
def reference(reference_run) -> Path:
    return reference_run("interrupt", RUN)


@pytest.mark.parametrize(("signame", "when", "stopped_at"), STOPS)
def test_a_signal_checkpoints_the_step_and_last_resumes_from_it(
    tmp_path, data_dir, reference, signame, when, stopped_at
):
    run = [*RUN, *run_dirs(tmp_path, data_dir)]
    where, step = when.split("=")
    stopped = cli(
        [
            *run,
            "+callbacks.stop._target_=_callbacks.SignalAtStep",
            f"+callbacks.stop.step={step}",
            f"+callbacks.stop.signame={signame}",
            f"+callbacks.stop.in_validation={where == 'validation'}",
        ],
        check=False,
        env=TEST_CALLBACKS,
    )
    out = stopped.stdout + stopped.stderr
    assert stopped.returncode == 128 + getattr(signal, signame), out[-3000:]
    checkpoints = tmp_path / "run" / "checkpoints"
    interrupted = checkpoints / "interrupted.ckpt"
    assert f"checkpoint written to {interrupted}" in out, out[-3000:]
    assert "Traceback" not in out, out[-3000:]
    # Ctrl+C is named as such (Lightning's graceful stop it goes through says SIGTERM)
    assert ("Received SIGTERM" in out) == (signame == "SIGTERM"), out[-3000:]
    assert _load(interrupted)["global_step"] == stopped_at
    assert _load(checkpoints / "last.ckpt")["global_step"] == 5  # the last periodic one

    resumed = cli([*run, "ckpt_path=last"])
    assert (resumed.stdout + resumed.stderr).count(f"resuming from {interrupted}") == 1
    assert not interrupted.exists()  # a run that ends normally removes it
    different = checkpoint_differences(reference, tmp_path / "run", 10)
    assert not different, f"{signame} {when}: {different}"


def test_an_error_in_a_step_writes_no_interruption_checkpoint(tmp_path, data_dir):
    """A NaN loss stops the run half-way through step 7: that state is not resumable, so
    only the periodic checkpoint of step 5 remains for `ckpt_path=last`."""
    failed = cli(
        [
            *RUN,
            *run_dirs(tmp_path, data_dir),
            "+callbacks.nan._target_=_callbacks.NaNAtStep",
            "+callbacks.nan.step=6",
        ],
        check=False,
        env=TEST_CALLBACKS,
    )
    assert failed.returncode == 1, (failed.stdout + failed.stderr)[-3000:]
    assert "the training loss is nan" in failed.stderr
    assert sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir()) == [
        "last.ckpt",
        "step000005.ckpt",
    ]
