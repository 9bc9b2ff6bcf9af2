"""Post-training under `trainer=fsdp2` on 2 CPU processes (docs/scaling.md, "Post-training
under FSDP2"): GRPO's rollout engine runs on full weights gathered from the shards once per
policy version, its reference (moving, `sync_interval`) is sharded like the policy, and the
runs equal the same runs under `trainer=ddp`, where the engine runs on the live model:

- GRPO and DPO: the loss of every one of 10 steps (averaged over the ranks) and the final
  weights within 1e-5 of DDP's; GRPO's rollouts token for token the same on each rank;
- GRPO killed at a random step and resumed (`ckpt_path=last`) ends bit for bit where the
  uninterrupted run does, with the same rollouts (the moving reference and each rank's
  generation batch travel in the sharded checkpoint);
- GRPO killed on 2 ranks resumes on 1: every step once, each on the global batch of the
  uninterrupted run.

The runs share the per-step records of tests/train/_rl_callbacks.py (`StepRecord`).
"""

from __future__ import annotations

import json
import random
import signal
from pathlib import Path

import pytest
import torch
from grpo_helpers import TINY_GRPO_CLI
from safetensors.torch import load_file
from train_helpers import TINY_MODEL, cli, run_dirs

pytestmark = pytest.mark.slow

HERE = Path(__file__).resolve().parent
ENV = {"PYTHONPATH": str(HERE)}  # _rl_callbacks, _callbacks, _rewards
STEPS = 10
TWO = ["trainer.accelerator=cpu", "trainer.devices=2"]
# mu = 2 (a checkpoint can fall between the passes over a generation batch), a moving
# reference (synced at steps 3, 6, 9: kept in the checkpoint), a checkpoint every step
# the evaluation callback every 5 steps (greedy, on rank 0, through the gathered weights)
GRPO = [
    *["callbacks=eval" if a == "callbacks=default" else a for a in TINY_GRPO_CLI],
    "callbacks.eval.every_n_steps=5",
    "callbacks.eval.suites.arithmetic.num_prompts=4",
    "callbacks.eval.suites.arithmetic.max_tokens=8",
    "strategy.sync_interval=3",
    f"trainer.max_steps={STEPS}",
    "callbacks.model_checkpoint.every_n_train_steps=1",
]
DPO = [
    *TINY_MODEL,
    "tokenizer.train.max_bytes=400000",
    "strategy=dpo",
    "data=arithmetic_preference",
    "data.train.prepare.builtin.n=48",
    "data.val.prepare.builtin.n=8",
    "data.num_workers=0",
    "callbacks.progress_bar=null",
    "trainer.enable_model_summary=false",
    f"trainer.max_steps={STEPS}",
    f"trainer.val_check_interval={STEPS}",
    "trainer.limit_val_batches=1",
    "optim.lr=1e-3",
]


def _run(where: Path, data_dir: Path, args: list[str], *, check: bool = True) -> int:
    record = [
        "+callbacks.rec._target_=_rl_callbacks.StepRecord",
        f"+callbacks.rec.path={where / 'rec'}",
    ]
    proc = cli([*args, *record, *run_dirs(where, data_dir)], env=ENV, check=check)
    return proc.returncode


def _steps(where: Path) -> list[dict]:
    return [json.loads(line) for line in (where / "rec" / "steps.jsonl").read_text().splitlines()]


def _rollouts(where: Path, rank: int) -> dict[int, dict]:
    """Each generation batch's rollouts on `rank`, by the step that first trained on it (a
    resumed run records the batch it resumed in once more: the same one)."""
    path = where / "rec" / f"rollouts.rank{rank}.jsonl"
    out: dict[int, dict] = {}
    for row in map(json.loads, path.read_text().splitlines()):
        if not any(r["completions"] == row["completions"] for r in out.values()):
            out[row["step"]] = row
    return out


def _weights(where: Path) -> dict[str, torch.Tensor]:
    return load_file(where / "run" / "export" / "model.safetensors")


def _max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def _eval_metrics(where: Path) -> dict[str, list[float]]:
    """The evaluation callback's metrics (`eval/*`, its timing left out) in the CSV log."""
    import csv

    (metrics,) = (where / "run" / "csv").glob("*/metrics.csv")
    with open(metrics) as fh:
        rows = list(csv.DictReader(fh))
    keys = [k for k in rows[0] if k.startswith("eval/") and not k.endswith("/seconds")]
    return {k: [float(r[k]) for r in rows if r[k]] for k in keys}


@pytest.fixture(scope="module")
def grpo_runs(shared_build, data_dir: Path) -> dict[str, Path]:
    """GRPO for 10 steps on 2 ranks of 2 prompts, under DDP and under FSDP2 (once), serving
    the live policy: a greedy request before steps 3 and 8 (`_rl_callbacks.ServeProbe`)."""
    args = [*GRPO, *TWO, "data.batch_size=2", "serve_policy.port=0"]
    args += ["+callbacks.serve._target_=_rl_callbacks.ServeProbe", "+callbacks.serve.steps=[3,8]"]
    return {
        trainer: shared_build(
            f"fsdp-rl-grpo-{trainer}",
            lambda where, t=trainer: _run(
                where, data_dir, [*args, f"trainer={t}", f"+callbacks.serve.path={where / 'rec'}"]
            ),
        )
        for trainer in ("ddp", "fsdp2")
    }


def test_grpo_under_fsdp2_equals_ddp(grpo_runs: dict[str, Path]) -> None:
    ddp, fsdp = grpo_runs["ddp"], grpo_runs["fsdp2"]
    shards = sorted(p.name for p in (fsdp / "run" / "checkpoints" / "last.ckpt").iterdir())
    assert shards == [".metadata", "__0_0.distcp", "__1_0.distcp", "meta.pt"], shards
    a, b = _steps(ddp), _steps(fsdp)
    assert [r["step"] for r in a] == [r["step"] for r in b] == list(range(1, STEPS + 1))
    assert any(abs(r["loss"]) > 1e-3 for r in a)  # the policy gets a signal
    worst = max(abs(x["loss"] - y["loss"]) for x, y in zip(a, b))
    assert worst <= 1e-5, f"FSDP2 vs DDP: max |loss difference| {worst:.2e}"
    for rank in (0, 1):
        ra, rb = _rollouts(ddp, rank), _rollouts(fsdp, rank)
        assert sorted(ra) == sorted(rb) and len(ra) == STEPS // 2, (sorted(ra), sorted(rb))
        for step in ra:
            assert ra[step]["completions"] == rb[step]["completions"], (rank, step)
            for x, y in zip(ra[step]["logprobs"], rb[step]["logprobs"]):
                torch.testing.assert_close(torch.tensor(y), torch.tensor(x), rtol=0, atol=1e-5)
    off = _max_diff(_weights(fsdp), _weights(ddp))
    assert off <= 1e-5, f"FSDP2 vs DDP: final weights max |difference| {off:.2e}"


def test_evaluation_and_the_live_policy_server_under_fsdp2_equal_ddp(
    grpo_runs: dict[str, Path],
) -> None:
    """Rank 0 evaluates and serves on its gathered copy while rank 1 joins the gathers: the
    same metrics (steps 0, 5, 10) and the same answers as on DDP's live model."""
    ddp, fsdp = grpo_runs["ddp"], grpo_runs["fsdp2"]
    ea, eb = _eval_metrics(ddp), _eval_metrics(fsdp)
    assert "eval/arithmetic/exact_match" in ea and len(ea["eval/arithmetic/exact_match"]) == 3
    assert ea == eb
    sa, sb = (
        [json.loads(line) for line in (w / "rec" / "served.jsonl").read_text().splitlines()]
        for w in (ddp, fsdp)
    )
    assert [r["step"] for r in sa] == [r["step"] for r in sb] == [3, 8]
    assert [r["fingerprint"] for r in sb] == ["policy-step-3", "policy-step-8"]
    for x, y in zip(sa, sb):
        assert x["text"] == y["text"]
        torch.testing.assert_close(torch.tensor(y["logprobs"]), torch.tensor(x["logprobs"]))


def test_grpo_under_fsdp2_killed_anywhere_resumes_bit_identical(
    tmp_path: Path, data_dir: Path, grpo_runs: dict[str, Path]
) -> None:
    kill_at = random.Random().randint(2, STEPS - 2)
    args = [*GRPO, *TWO, "data.batch_size=2", "trainer=fsdp2"]
    kill = ["+callbacks.kill._target_=_callbacks.KillAtStep", f"+callbacks.kill.step={kill_at}"]
    killed = _run(tmp_path, data_dir, [*args, *kill], check=False)
    assert killed == -signal.SIGKILL, f"killed at step {kill_at}: status {killed}"
    _run(tmp_path, data_dir, [*args, "ckpt_path=last"])
    ref = grpo_runs["fsdp2"]
    a, b = _steps(ref), _steps(tmp_path)
    assert [r["step"] for r in b] == list(range(1, STEPS + 1)), f"killed at step {kill_at}"
    assert [r["loss"] for r in a] == [r["loss"] for r in b], f"killed at step {kill_at}"
    for rank in (0, 1):
        assert _rollouts(ref, rank) == _rollouts(tmp_path, rank), f"killed at step {kill_at}"
    w, wref = _weights(tmp_path), _weights(ref)
    different = [k for k in wref if not torch.equal(w[k], wref[k])]
    assert not different, f"killed at step {kill_at}: {different}"


def test_grpo_under_fsdp2_resumes_on_another_number_of_ranks(
    tmp_path: Path, data_dir: Path, grpo_runs: dict[str, Path]
) -> None:
    """Killed on 2 ranks at a generation batch's end (a checkpoint between mu's passes holds
    each rank's batch and resumes at its own number of ranks only), resumed on 1 rank of
    twice the prompts: every step once, and each step's global batch is the uninterrupted
    run's (the sampler's position is a global sample offset, whatever the ranks). The
    rollouts themselves depend on how prompts fall to ranks, so the losses are not compared
    after the stop."""
    kill_at = random.Random().choice([2, 4, 6])
    args = [*GRPO, *TWO, "data.batch_size=2", "trainer=fsdp2"]
    kill = ["+callbacks.kill._target_=_callbacks.KillAtStep", f"+callbacks.kill.step={kill_at}"]
    assert _run(tmp_path, data_dir, [*args, *kill], check=False) == -signal.SIGKILL
    one = [*GRPO, "trainer=fsdp2", "trainer.accelerator=cpu", "trainer.devices=1"]
    _run(tmp_path, data_dir, [*one, "data.batch_size=4", "ckpt_path=last"])
    rows, two = _steps(tmp_path), _steps(grpo_runs["fsdp2"])
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1)), "a step repeated or missing"
    assert [r["world"] for r in rows] == [2] * kill_at + [1] * (STEPS - kill_at)
    assert [r["loss"] for r in rows[:kill_at]] == [r["loss"] for r in two[:kill_at]]
    for r, same in zip(rows, two):
        assert r["prompts"] == same["prompts"], f"step {r['step']}: other prompts"
    assert all(torch.isfinite(torch.tensor(r["loss"])) for r in rows)
    assert (tmp_path / "run" / "export" / "model.safetensors").is_file()


def test_dpo_under_fsdp2_equals_ddp(tmp_path: Path, data_dir: Path) -> None:
    """DPO's reference is a sharded copy of the initial policy under FSDP2."""
    args = [*DPO, *TWO, "data.batch_size=2"]
    _run(tmp_path / "ddp", data_dir, [*args, "trainer=ddp"])
    _run(tmp_path / "fsdp2", data_dir, [*args, "trainer=fsdp2"])
    a, b = _steps(tmp_path / "ddp"), _steps(tmp_path / "fsdp2")
    assert [r["step"] for r in a] == [r["step"] for r in b] == list(range(1, STEPS + 1))
    assert a[-1]["loss"] < a[0]["loss"] - 0.1  # it learns: the comparison is of moving weights
    worst = max(abs(x["loss"] - y["loss"]) for x, y in zip(a, b))
    assert worst <= 1e-5, f"FSDP2 vs DDP: max |loss difference| {worst:.2e}"
    off = _max_diff(_weights(tmp_path / "fsdp2"), _weights(tmp_path / "ddp"))
    assert off <= 1e-5, f"FSDP2 vs DDP: final weights max |difference| {off:.2e}"
