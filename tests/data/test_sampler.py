"""ResumableSampler: deterministic order, rank sharding, exact resume (also across world sizes)."""

from __future__ import annotations

import itertools

import pytest

from astrai.data.sampler import ResumableSampler


def _take(it, n: int) -> list[int]:
    return list(itertools.islice(it, n))


def test_order_is_deterministic_in_seed_and_epoch() -> None:
    a = list(ResumableSampler(50, seed=1))
    assert a == list(ResumableSampler(50, seed=1))
    assert sorted(a) == list(range(50)) and a != list(range(50))
    assert a != list(ResumableSampler(50, seed=2))
    s = ResumableSampler(50, seed=1)
    s.set_epoch(1)
    assert list(s) != a and sorted(s.epoch_order().tolist()) == list(range(50))
    assert list(ResumableSampler(5, shuffle=False)) == [0, 1, 2, 3, 4]


def test_ranks_partition_the_epoch() -> None:
    n, world = 23, 3
    per_rank = [list(ResumableSampler(n, seed=0, rank=r, world_size=world)) for r in range(world)]
    assert all(len(p) == 8 for p in per_rank)  # ceil(23 / 3), padded
    seen = sorted(i for p in per_rank for i in p)
    assert set(seen) == set(range(n)) and len(seen) == 24  # one repeat pads the last step
    dropped = [
        list(ResumableSampler(n, seed=0, rank=r, world_size=world, drop_last=True))
        for r in range(world)
    ]
    flat = [i for p in dropped for i in p]
    assert all(len(p) == 7 for p in dropped) and len(set(flat)) == 21


def test_iterating_without_set_epoch_moves_to_the_next_epoch() -> None:
    s = ResumableSampler(10, seed=0)
    first, second = list(s), list(s)
    assert first != second and sorted(second) == list(range(10))
    assert s.state_dict()["epoch"] == 1


@pytest.mark.parametrize("k", [0, 3, 17, 39])
def test_resume_continues_with_the_first_unseen_sample(k: int) -> None:
    n = 40
    reference = list(ResumableSampler(n, seed=5))
    s = ResumableSampler(n, seed=5)
    it = iter(s)
    head = _take(it, k)
    state = s.state_dict()
    assert state == {
        "epoch": 0,
        "consumed": k,
        "seed": 5,
        "world_size": 1,
        "num_samples": n,
        "epoch_offset": 0,
    }
    resumed = ResumableSampler(n, seed=5)
    resumed.load_state_dict(state)
    tail = list(resumed)
    assert head + tail == reference
    assert len(resumed) == n  # Lightning counts batches from the epoch start


def test_resume_at_the_end_of_an_epoch_starts_the_next() -> None:
    s = ResumableSampler(12, seed=5)
    list(s)
    resumed = ResumableSampler(12, seed=5)
    resumed.load_state_dict(s.state_dict())
    expected = ResumableSampler(12, seed=5)
    expected.set_epoch(1)
    assert list(resumed) == list(expected)


def _lockstep(samplers: list[ResumableSampler], steps: int, batch: int) -> list[list[int]]:
    """Advance all ranks by ``steps`` batches, as DDP does; return what each rank took."""
    iters = [iter(s) for s in samplers]
    taken: list[list[int]] = [[] for _ in samplers]
    for _ in range(steps):
        for r, it in enumerate(iters):
            taken[r] += _take(it, batch)
    return taken


@pytest.mark.parametrize(("before", "after"), [(2, 1), (1, 2), (2, 3), (4, 2)])
def test_changing_the_number_of_ranks_loses_and_repeats_nothing(before: int, after: int) -> None:
    n, batch, steps = 48, 2, 3
    old = [ResumableSampler(n, seed=7, rank=r, world_size=before) for r in range(before)]
    taken = _lockstep(old, steps, batch)
    states = [s.state_dict() for s in old]
    assert all(st == states[0] for st in states)  # every rank saves the same position
    assert states[0]["consumed"] == before * steps * batch
    new = [ResumableSampler(n, seed=7, rank=r, world_size=after) for r in range(after)]
    for s in new:
        s.load_state_dict(states[0])
    rest = [list(s) for s in new]
    used = [i for part in taken + rest for i in part]
    assert sorted(used) == list(range(n))  # each sample exactly once in the epoch
    # and the first consumed positions of the epoch order are exactly what was used before
    order = old[0].epoch_order().tolist()
    assert sorted(i for part in taken for i in part) == sorted(order[: states[0]["consumed"]])


def test_resume_len_matches_the_full_epoch_with_the_same_ranks() -> None:
    s = [ResumableSampler(40, seed=0, rank=r, world_size=2) for r in range(2)]
    _lockstep(s, 3, 4)
    fresh = ResumableSampler(40, seed=0, rank=1, world_size=2)
    fresh.load_state_dict(s[0].state_dict())
    assert len(fresh) == 20 and len(list(fresh)) == 20 - 12


def test_load_state_dict_refuses_other_data_or_seed() -> None:
    s = ResumableSampler(10, seed=0)
    with pytest.raises(ValueError, match="for 12 samples but the dataset has 10"):
        s.load_state_dict({"epoch": 0, "consumed": 2, "seed": 0, "num_samples": 12})
    with pytest.raises(ValueError, match="seed 3"):
        s.load_state_dict({"epoch": 0, "consumed": 2, "seed": 3, "num_samples": 10})
    with pytest.raises(ValueError, match="num_samples must be positive"):
        ResumableSampler(0)
    with pytest.raises(ValueError, match="invalid rank 2"):
        ResumableSampler(5, rank=2, world_size=2)


def test_set_epoch_resets_only_when_the_epoch_changes() -> None:
    s = ResumableSampler(10, seed=0)
    _take(iter(s), 4)
    s.set_epoch(0)  # Lightning calls this again when resuming mid-epoch
    assert s.consumed == 4
    s.set_epoch(1)
    assert s.consumed == 0 and s.epoch == 1


def test_a_restore_keeps_its_epoch_when_lightning_counts_one_ahead() -> None:
    """A run stopped by max_steps mid-epoch is checkpointed by Lightning as if the epoch had
    ended; resumed, Lightning calls set_epoch(1). The data finishes epoch 0 first, then goes
    on with epoch 1 at Lightning's epoch 2, exactly as the uninterrupted sampler does."""
    straight = ResumableSampler(10, seed=3)
    first = _take(iter(straight), 10)
    straight.set_epoch(1)
    second = _take(iter(straight), 10)

    stopped = ResumableSampler(10, seed=3)
    assert _take(iter(stopped), 4) == first[:4]
    resumed = ResumableSampler(10, seed=3)
    resumed.load_state_dict(stopped.state_dict())
    resumed.set_epoch(1)  # Lightning's count, one ahead of the data
    assert _take(iter(resumed), 6) == first[4:]
    assert resumed.state_dict()["epoch_offset"] == 1
    again = ResumableSampler(10, seed=3)  # checkpointed and restored once more
    again.load_state_dict(resumed.state_dict())
    again.set_epoch(2)
    assert _take(iter(again), 10) == second
    assert again.epoch == 1 and again.epoch_offset == 1
