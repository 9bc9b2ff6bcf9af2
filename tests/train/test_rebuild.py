"""`astrai.train.rebuild.Rebuilder`: the weights of any step of a ledger run, from the nearest
checkpoint plus a ledger replay, equal the uninterrupted run's there, bit for bit."""

from __future__ import annotations

import pytest
import torch
from bisect_helpers import planted_run, sparse_copy

from astrai.train.rebuild import Rebuilder
from astrai.train.replay import ReplayError

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def planted(reference_run):
    return planted_run(reference_run)


def test_rebuilt_weights_equal_the_uninterrupted_runs(planted, tmp_path):
    """The reference checkpointed every step; the copy keeps step 3's checkpoint only."""
    sparse = sparse_copy(planted, tmp_path / "run", keep=("step000003.ckpt",))
    with Rebuilder(sparse) as rebuilder:
        for step in (1, 2, 3, 5, 8):
            state = rebuilder.at(step).state_dict()
            ref = torch.load(
                planted / "checkpoints" / f"step{step:06d}.ckpt",
                map_location="cpu",
                weights_only=False,
            )["state_dict"]
            assert list(state) == list(ref), step
            different = [k for k in ref if not torch.equal(state[k].cpu(), ref[k])]
            assert not different, f"step {step}: {different[:5]}"
        # each state continued from the nearest one it had: 1 (start), 2 (from 1), 3 (its
        # checkpoint), 4-5 (from 3), 6-8 (from 5)
        assert rebuilder.replayed == 1 + 1 + 0 + 2 + 3


def test_rebuild_refuses_what_it_cannot_do(planted, tmp_path):
    with Rebuilder(planted) as rebuilder, pytest.raises(ReplayError, match="step 9 is not"):
        rebuilder.at(9)
    bare = sparse_copy(planted, tmp_path / "bare", keep=())
    (bare / "ledger.h5").unlink()
    with pytest.raises(ReplayError, match="train with ledger=true"):
        Rebuilder(bare)
