"""`python -m astrai.train +experiment=tiny_sft data.padding_free=true data.use_dynamic_bsz=true
data.max_token_len_per_gpu=N`: every step trains on one row of whole samples within the budget
(their number varies). A run SIGKILLed in the middle of a step (within an epoch, and in the
first step of the next), resumed from its last checkpoint, trains on the same rows and ends
with the uninterrupted run's weights and optimizer state, bit for bit (the data position
counts samples: `astrai.data.budget`). Under DDP on 2 processes both ranks take every step,
and the batches are the 1-process run's, dealt out in turn."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from train_helpers import SMALL, TINY_MODEL, checkpoint_differences, cli, run_dirs

pytestmark = pytest.mark.slow

HERE = Path(__file__).resolve().parent
BUDGET = 400
STEPS = 10
RUN = [
    "experiment=tiny_sft",
    *TINY_MODEL,
    SMALL[0],
    "callbacks.eval=null",
    "callbacks.progress_bar=null",
    "trainer.enable_model_summary=false",
    f"trainer.max_steps={STEPS}",
    f"trainer.val_check_interval={STEPS}",
    "trainer.limit_val_batches=1",
    "callbacks.model_checkpoint.every_n_train_steps=2",
    "optim.schedule.warmup_steps=2",
    "data.train.prepare.builtin.n=24",  # about 5 steps an epoch: the runs cross one
    "data.val.prepare.builtin.n=8",
    "data.batch_size=4",  # validation batches only (training batches hold what the budget allows)
    "data.padding_free=true",
    "data.use_dynamic_bsz=true",
    f"data.max_token_len_per_gpu={BUDGET}",
    "+callbacks.rows._target_=_budget_callbacks.PackedRows",
]
ENV = {"PYTHONPATH": str(HERE)}


def _rows(where: Path) -> dict[tuple[int, int], dict]:
    """Each (step, rank)'s row (a resumed run rewrites the steps after its checkpoint: the
    last one written wins)."""
    lines = (where / "rows.jsonl").read_text().splitlines()
    return {(row["step"], row["rank"]): row for row in map(json.loads, lines)}


def _run(where: Path, data_dir: Path, *extra: str, check: bool = True) -> int:
    rows = f"+callbacks.rows.path={where / 'rows.jsonl'}"
    return cli([*RUN, rows, *run_dirs(where, data_dir), *extra], env=ENV, check=check).returncode


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory, data_dir: Path) -> Path:
    where = tmp_path_factory.mktemp("budget-reference")
    _run(where, data_dir)
    return where


def test_budgeted_rows_and_kill_anywhere_resume(tmp_path: Path, data_dir: Path, reference) -> None:
    rows = _rows(reference)
    assert sorted(rows) == [(step, 0) for step in range(1, STEPS + 1)]
    assert all(r["shape"][0] == 1 and r["shape"][1] <= BUDGET for r in rows.values())
    assert len({len(r["samples"]) for r in rows.values()}) > 1, rows  # samples per step vary
    # each epoch takes all 24 samples once (the steps of an epoch vary: none is cut short)
    flat = [s for step in range(1, STEPS + 1) for s in rows[step, 0]["samples"]]
    assert len(set(flat[:24])) == 24 and len(set(flat[24:])) == len(flat[24:]) > 12
    # killed in the first step of the second epoch (resumed from the previous epoch's
    # checkpoint: the cuts of the epoch the kill interrupted are made again); kills in other
    # steps are tests/train/test_resume.py's (the same sampler position, fixed batches)
    for step in (5,):
        where = tmp_path / f"killed{step}"
        kill = ["+callbacks.kill._target_=_callbacks.KillAtStep", f"+callbacks.kill.step={step}"]
        assert _run(where, data_dir, *kill, check=False) == -9
        _run(where, data_dir, "ckpt_path=last")
        assert _rows(where) == rows, f"killed in step {step + 1}"  # the same row every step
        assert not checkpoint_differences(reference / "run", where / "run", STEPS), step


def test_two_ranks_killed_resume_on_one_with_nothing_lost_or_repeated(
    tmp_path: Path, data_dir: Path, reference
) -> None:
    """2 ranks (every step on the 1-process run's batches, two per step) SIGKILLed in step 3 (their first epoch, 4 of its 5 batches, ended at step 2:
    the odd batch is dropped with data.drop_last), resumed on 1 process from the checkpoint of
    step 2: the one process takes the fifth batch, then the next epoch; the batches in order
    are the uninterrupted 1-process run's."""
    ddp = ["trainer=ddp", "trainer.accelerator=cpu", "trainer.devices=2"]
    every = "callbacks.model_checkpoint.every_n_train_steps=1"
    kill = ["+callbacks.kill._target_=_callbacks.KillAtStep", "+callbacks.kill.step=2"]
    assert _run(tmp_path, data_dir, *ddp, every, *kill, check=False) == -9
    _run(tmp_path, data_dir, every, "ckpt_path=last")
    rows, single = _rows(tmp_path), _rows(reference)
    assert sorted(rows) == [(1, 0), (1, 1), (2, 0), (2, 1), *((s, 0) for s in range(3, 11))]
    assert all(r["shape"][1] <= BUDGET for r in rows.values())
    # the first epoch's cuts do not depend on the number of ranks: step k of 2 ranks trains
    # on the 1-process run's batches 2k - 1 and 2k, no sample twice
    for step in (1, 2):
        for rank in (0, 1):
            assert rows[step, rank]["samples"] == single[2 * step - 1 + rank, 0]["samples"]
    seen = [s for step in (1, 2) for rank in (0, 1) for s in rows[step, rank]["samples"]]
    assert len(seen) == len(set(seen))
    taken = [rows[key]["samples"] for key in sorted(rows)]
    assert taken[:STEPS] == [single[step, 0]["samples"] for step in range(1, STEPS + 1)]
