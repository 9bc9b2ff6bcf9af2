"""Sharded checkpoints (`trainer=fsdp2`: torch.distributed.checkpoint folders) resume at another
number of ranks: a 2-rank run killed at a random step goes on with 1 rank, a 1-rank run stopped
by SIGTERM goes on with 2 (from a sharded checkpoint, or from the single file of a run without
FSDP), with the global batch kept (8 = 2 x 4 = 1 x 8).

Before the stop, a run is bit-identical to the uninterrupted run of its own size. After the
resume, it trains on exactly the samples the uninterrupted run of the new size trains on at
each step (the sampler's position is a global sample offset, `astrai.data.ResumableSampler`:
nothing seen again, nothing skipped), and its losses equal that run's up to the last bits
that the other reduction order left in the weights at the stop (bounded by 1e-5 here).
"""

from __future__ import annotations

import json
import random
import signal
from collections import Counter
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from train_helpers import SMALL, TINY_MODEL, cli

from astrai.train.checkpoint_io import AtomicCheckpointIO, ShardedCheckpointError

HERE = Path(__file__).resolve().parent
STEPS = 12
COMMON = [
    *TINY_MODEL,
    *SMALL,
    "trainer.accelerator=cpu",
    "callbacks.progress_bar=null",
    "trainer.enable_model_summary=false",
    f"trainer.max_steps={STEPS}",
    f"trainer.val_check_interval={STEPS}",
    "trainer.limit_val_batches=1",
    "optim.lr=1e-2",
    "optim.schedule.warmup_steps=3",
    "trainer.gradient_clip_val=0.5",
    "callbacks.model_checkpoint.every_n_train_steps=1",
    "+callbacks.losses._target_=_scale_callbacks.GlobalLoss",
]
SIZE = {
    1: ["trainer.devices=1", "data.batch_size=8", "data.val_batch_size=8"],
    2: ["trainer.devices=2", "data.batch_size=4", "data.val_batch_size=4"],
}


def _run(
    tmp: Path, data_dir: Path, world: int, *extra: str, check: bool = True, trainer: str = "fsdp2"
) -> int:
    proc = cli(
        [
            f"trainer={trainer}",
            *COMMON,
            *SIZE[world],
            *extra,
            f"+callbacks.losses.path={tmp / 'losses.jsonl'}",
            f"paths.data_dir={data_dir}",
            f"paths.log_dir={tmp / 'outputs'}",
            f"hydra.run.dir={tmp / 'run'}",
        ],
        env={"PYTHONPATH": str(HERE)},
        check=check,
    )
    return proc.returncode


def _steps(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "losses.jsonl").read_text().splitlines()]


def _weights(run: Path) -> dict[str, torch.Tensor]:
    return load_file(run / "run" / "export" / "model.safetensors")


@pytest.fixture(scope="module")
def uninterrupted(shared_build, data_dir: Path) -> dict[int, Path]:
    """The reference runs: 1 rank x 8 and 2 ranks x 4, never stopped (once per session)."""
    return {
        world: shared_build(
            f"world-size-uninterrupted{world}", lambda where, w=world: _run(where, data_dir, w)
        )
        for world in (1, 2)
    }


def _check_continuation(resumed: Path, refs: dict[int, Path], before: int, after: int) -> str:
    """The stopped-and-resumed run `resumed` (at `before` ranks, then `after`) against the
    uninterrupted runs; returns the figures for the failure messages."""
    rows = _steps(resumed)
    ref_before = {r["step"]: r for r in _steps(refs[before])}
    ref_after = {r["step"]: r for r in _steps(refs[after])}
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1)), "a step repeated or missing"
    stop = max(r["step"] for r in rows if r["world"] == before)
    assert 1 < stop < STEPS and {r["world"] for r in rows} == {before, after}
    for r in rows[:stop]:  # the same size, the same computation: bit for bit
        assert r["loss"] == ref_before[r["step"]]["loss"], r["step"]
        assert r["samples"] == ref_before[r["step"]]["samples"], r["step"]
    diffs = []
    for r in rows[stop:]:
        assert r["samples"] == ref_after[r["step"]]["samples"], f"step {r['step']}: other samples"
        diffs.append(abs(r["loss"] - ref_after[r["step"]]["loss"]))
    figures = f"stopped after step {stop}; max |loss difference| after it {max(diffs):.2e}"
    assert max(diffs) <= 1e-5, figures
    # no sample trained on twice within the epoch, none left out: the reference's multiset
    seen = Counter(s for r in rows for s in r["samples"])
    assert seen == Counter(s for r in ref_after.values() for s in r["samples"]), figures
    assert max(seen.values()) == 1, figures
    # the final weights: no farther from the new size's run than the two sizes' uninterrupted
    # runs are from each other (Adam turns last-bit gradient differences into ~lr-sized ones
    # on elements with tiny second moments, so that gap, not 1e-5, is the scale)
    w, ref, other = _weights(resumed), _weights(refs[after]), _weights(refs[before])
    gap = max(float((ref[k] - other[k]).abs().max()) for k in ref)
    off = max(float((w[k] - ref[k]).abs().max()) for k in ref)
    figures += f"; final weights max |difference| {off:.2e} (the two sizes differ by {gap:.2e})"
    assert gap < 1e-4 and off <= 2 * gap + 1e-6, figures
    return figures


@pytest.mark.slow
def test_two_ranks_killed_at_a_random_step_resume_on_one(
    tmp_path: Path, data_dir: Path, uninterrupted: dict[int, Path]
) -> None:
    kill_at = random.Random().randint(2, STEPS - 3)
    killed = _run(
        tmp_path,
        data_dir,
        2,
        "+callbacks.kill._target_=_callbacks.KillAtStep",
        f"+callbacks.kill.step={kill_at}",
        check=False,
    )
    assert killed == -signal.SIGKILL, f"killed at step {kill_at}: status {killed}"
    last = tmp_path / "run" / "checkpoints" / "last.ckpt"
    assert sorted(p.name for p in last.iterdir()) == [
        ".metadata",
        "__0_0.distcp",
        "__1_0.distcp",
        "meta.pt",
    ]
    _run(tmp_path, data_dir, 1, "ckpt_path=last")
    _check_continuation(tmp_path, uninterrupted, before=2, after=1)


@pytest.mark.slow
@pytest.mark.parametrize(
    "start",
    [
        pytest.param("fsdp2", id="sharded-checkpoint"),
        # a one-process run's single-file checkpoint, continued sharded on 2 ranks
        pytest.param("default", id="single-file-checkpoint"),
    ],
)
def test_one_rank_stopped_by_sigterm_resumes_on_two(
    tmp_path: Path, data_dir: Path, uninterrupted: dict[int, Path], start: str
) -> None:
    stop_in = random.Random().randint(2, STEPS - 3)
    stopped = _run(
        tmp_path,
        data_dir,
        1,
        "+callbacks.stop._target_=_callbacks.SignalAtStep",
        f"+callbacks.stop.step={stop_in}",
        check=False,
        trainer=start,
    )
    assert stopped == 128 + signal.SIGTERM, f"SIGTERM in step {stop_in}: status {stopped}"
    interrupted = tmp_path / "run" / "checkpoints" / "interrupted.ckpt"
    if start == "fsdp2":
        assert (interrupted / ".metadata").is_file() and (interrupted / "meta.pt").is_file()
    else:
        assert interrupted.is_file()
    _run(tmp_path, data_dir, 2, "ckpt_path=last")
    assert not interrupted.exists()  # a run that ends normally removes it
    _check_continuation(tmp_path, uninterrupted, before=1, after=2)


def test_a_sharded_checkpoint_under_a_single_file_strategy_names_the_way_to_resume(
    tmp_path: Path,
) -> None:
    sharded = tmp_path / "last.ckpt"
    sharded.mkdir()
    (sharded / ".metadata").write_bytes(b"")
    with pytest.raises(ShardedCheckpointError, match=r"ckpt_path: .*last\.ckpt.*trainer=fsdp2"):
        AtomicCheckpointIO().load_checkpoint(sharded)
    whole = tmp_path / "whole.ckpt"
    AtomicCheckpointIO().save_checkpoint({"global_step": 3}, whole)
    assert AtomicCheckpointIO().load_checkpoint(whole)["global_step"] == 3
