"""`astrai.train.attribute`: leave-one-group-out replays of a step rank first the rollout
group planted to push the probe; slices of a batch for the other strategies."""

from __future__ import annotations

import pytest
import torch
from _probes import completion_logprob, weight_norm
from bisect_helpers import FLIP, GROUP, planted_run

from astrai.train.attribute import attribute, slice_rows
from astrai.train.ledger_store import LedgerFile
from astrai.train.probe import CallableProbe, Condition
from astrai.train.rebuild import Rebuilder

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def planted(reference_run):
    return planted_run(reference_run)


def flip_rollouts(run):
    """The generation batch step FLIP trained on (sampled after step FLIP - 1)."""
    with LedgerFile(run / "ledger.h5") as ledger:
        seeds, steps = ledger.h5["rollouts/seed"][:], ledger.h5["rollouts/step"][:]
        return ledger.rollout(int(seeds[list(steps).index(FLIP - 1)]))


def test_attribute_ranks_the_poisoned_group_first(planted):
    rec = flip_rollouts(planted)
    rewards = torch.tensor(rec["rewards"]).view(-1, GROUP)
    poisoned = int(rewards.abs().amax(dim=1).argmax())
    assert rewards[poisoned].max() >= 10  # the planted group is there (x10 rewards)
    best = [
        (rec["prompts"][i], rec["completions"][i])
        for i in range(poisoned * GROUP, (poisoned + 1) * GROUP)
        if rec["rewards"][i] == float(rewards[poisoned].max())
    ]
    probe = CallableProbe(completion_logprob(best), "logp of the poisoned group's best")
    with Rebuilder(planted) as rebuilder:
        before = probe(rebuilder.at(FLIP - 1), rebuilder.tokenizer)["logp"]
        result = attribute(rebuilder, FLIP, probe, Condition("logp", ">", before), before=before)
    assert result.value > before  # the step raised them
    assert len(result.units) == len(rewards)
    assert result.units[0].index == poisoned, [(u.index, u.push) for u in result.units]
    top = result.units[0]
    assert [c["reward"] for c in top.completions] == rec["rewards"][
        poisoned * GROUP : (poisoned + 1) * GROUP
    ]
    assert top.prompt and all(c["text"] is not None for c in top.completions)
    # group normalisation off (scale_rewards=none): the advantage is the reward minus its
    # group's mean (Dr. GRPO)
    mean = float(rewards[poisoned].mean())
    assert [c["advantage"] for c in top.completions] == pytest.approx(
        [c["reward"] - mean for c in top.completions], abs=1e-5
    )


def test_slice_rows_leaves_out_one_slice():
    batch = {
        "input_ids": torch.arange(12).view(6, 2),
        "labels": torch.arange(6),
        "n": 3,
        "texts": list("abcdef"),
    }
    out = slice_rows(batch, drop=1, slices=3)  # rows 2, 3
    assert torch.equal(out["input_ids"], batch["input_ids"][[0, 1, 4, 5]])
    assert out["texts"] == ["a", "b", "e", "f"] and out["n"] == 3


def test_attribute_slices_of_a_batch(reference_run):
    from test_replay import PRETRAIN

    run = reference_run("ledger-pretrain", PRETRAIN)
    probe = CallableProbe(weight_norm)
    with Rebuilder(run) as rebuilder:
        ids = list(rebuilder.ledger.step(3)["sample_ids"])
        result = attribute(rebuilder, 3, probe, Condition("norm", ">", 0.0), slices=4)
    assert result.kind == "slice" and len(result.units) == 4
    assert sorted(i for u in result.units for i in u.sample_ids) == sorted(ids)
    assert len({u.metric_without for u in result.units} | {result.value}) == 5  # each moved it
