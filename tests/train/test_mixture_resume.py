"""Kill-anywhere resume with a mixture of training sources (conf/data/arithmetic_sft_mix.yaml,
three built-in sources drawn 0.5 / 0.3 / 0.2): a run SIGKILLed after a checkpoint and resumed
ends with the uninterrupted run's weights and optimizer state, bit for bit, at 1 and at 2
ranks; and a 2-rank run resumed on 1 rank trains on the very samples, in the same order, as
the uninterrupted runs (the mixture's order is global: a function of the seed; the position
is a count of samples). The step ledger names each sample's source.

Each epoch is 48 samples (``data.train.num_samples``), 6 steps of 8: the kills land after
the checkpoint that ends the first epoch and inside the second, where the sources' offsets
are no longer 0.
"""

from __future__ import annotations

import shutil
from collections import Counter
from pathlib import Path

import pytest
from train_helpers import TINY_MODEL, checkpoint_differences, cli, run_dirs

from astrai.train.ledger_store import LedgerFile

pytestmark = pytest.mark.slow

HERE = Path(__file__).resolve().parent
KILL = {"PYTHONPATH": str(HERE)}  # the test-only KillAtStep callback
STEPS = 10
RUN = [
    "data=arithmetic_sft_mix",
    "strategy=sft",
    *TINY_MODEL,
    "tokenizer.train.max_bytes=400000",
    "data.train.prepare.builtin.n=64",
    "data.train.sources.1.prepare.builtin.n=64",
    "data.train.sources.2.prepare.builtin.n=128",
    "data.train.num_samples=48",
    "data.val.prepare.builtin.n=16",
    "ledger=true",
    "callbacks.progress_bar=null",
    "trainer.enable_model_summary=false",
    "trainer.accelerator=cpu",
    f"trainer.max_steps={STEPS}",
    "trainer.val_check_interval=5",
    "trainer.limit_val_batches=1",
    "callbacks.model_checkpoint.every_n_train_steps=2",
    "optim.schedule.warmup_steps=3",
    "strategy.lora={r: 4, lora_alpha: 8, lora_dropout: 0.2}",  # randomness in every step
]
RANKS = {
    1: ["data.batch_size=8", "data.val_batch_size=8"],
    2: ["trainer=ddp", "trainer.devices=2", "data.batch_size=4", "data.val_batch_size=4"],
}


def _samples(run: Path) -> list[tuple[list[int], list[int]]]:
    """Each step's (sample ids, their sources) from a run's ledger."""
    with LedgerFile(run / "ledger.h5") as ledger:
        assert ledger.steps == list(range(1, STEPS + 1))
        assert ledger.meta["data_sources"] == ["arithmetic", "tools", "countdown"]
        return [
            (ledger.step(s)["sample_ids"], ledger.step(s)["sample_sources"]) for s in ledger.steps
        ]


def _killed(where: Path, data_dir: Path, ranks: int, step: int) -> list[str]:
    run = [*RUN, *RANKS[ranks], *run_dirs(where, data_dir)]
    kill = ["+callbacks.kill._target_=_callbacks.KillAtStep", f"+callbacks.kill.step={step}"]
    killed = cli([*run, *kill], check=False, env=KILL)
    assert killed.returncode == -9, killed.stderr[-3000:]
    return run


@pytest.fixture(scope="module")
def one_rank(reference_run) -> Path:
    return reference_run("mixture-1", [*RUN, *RANKS[1]])


def test_a_mixture_killed_anywhere_resumes_bit_identical(one_rank, tmp_path, data_dir):
    samples = _samples(one_rank)
    ids = [i for step, _ in samples[:6] for i in step]
    assert len(ids) == 48 and len(set(ids)) == 48  # the first epoch: no sample twice
    drawn = Counter(s for _, sources in samples for s in sources)
    assert set(drawn) == {0, 1, 2} and sum(drawn.values()) == 8 * STEPS
    for step in (6, 8):  # at the end of the first epoch, and inside the second
        where = tmp_path / f"kill{step}"
        run = _killed(where, data_dir, 1, step)
        cli([*run, "ckpt_path=last"])
        assert not checkpoint_differences(one_rank, where / "run", STEPS), f"killed at {step}"
        assert _samples(where / "run") == samples
        shutil.rmtree(where)


def test_two_ranks_resume_bit_identical_and_on_one_rank_in_the_same_order(
    one_rank, reference_run, tmp_path, data_dir
):
    two_ranks = reference_run("mixture-2", [*RUN, *RANKS[2]])
    samples = _samples(one_rank)
    assert _samples(two_ranks) == samples  # the global order does not depend on the ranks
    run = _killed(tmp_path / "two", data_dir, 2, 8)
    shutil.copytree(tmp_path / "two", tmp_path / "one")
    cli([*run, "ckpt_path=last"])
    assert not checkpoint_differences(two_ranks, tmp_path / "two" / "run", STEPS)
    assert _samples(tmp_path / "two" / "run") == samples
    one = [*RUN, *RANKS[1], *run_dirs(tmp_path / "one", data_dir), "ckpt_path=last"]
    cli(one)  # the same global batch of 8 on one rank
    assert _samples(tmp_path / "one" / "run") == samples
