"""Training batches by token budget (data.use_dynamic_bsz, data.max_token_len_per_gpu): batches
cut in order from the epoch's global permutation within the budget, every sample once per epoch
on 1, 2 and 3 ranks, every rank the same number of steps, and a resume (at the same or another
number of ranks, or budget) that continues with exactly the samples not yet used."""

from __future__ import annotations

import itertools
import re
from pathlib import Path

import numpy as np
import pytest
import torch

from astrai.data.budget import TokenBudgetSampler, budget_ends
from astrai.data.datamodule import AstraiDataModule
from astrai.data.datasets import SFTDataset
from astrai.data.storage import H5Writer

LENGTHS = np.random.default_rng(0).integers(1, 30, size=57)
BUDGET = 40


def _greedy(lengths: list[int], budget: int) -> list[list[int]]:
    """The reference cut: a plain walk that closes a batch when the next sample would not fit."""
    batches: list[list[int]] = [[]]
    total = 0
    for position, length in enumerate(lengths):
        if total + length > budget:
            batches.append([])
            total = 0
        batches[-1].append(position)
        total += length
    return batches


def _samplers(world: int, lengths=LENGTHS, budget=BUDGET, **kw) -> list[TokenBudgetSampler]:
    return [
        TokenBudgetSampler(lengths, budget, seed=3, rank=r, world_size=world, **kw)
        for r in range(world)
    ]


def _lockstep(samplers: list[TokenBudgetSampler], steps: int | None = None) -> list[list[int]]:
    """Every rank takes a batch per step, as under DDP; returns the batches in global order
    (step 0 rank 0, step 0 rank 1, ...)."""
    iters = [iter(s) for s in samplers]
    out: list[list[int]] = []
    for _ in itertools.count() if steps is None else range(steps):
        step = [next(it, None) for it in iters]
        if all(b is None for b in step):
            break
        assert None not in step, "a rank ran out of batches before the others"
        out += step
    return out


def test_cuts_are_the_plain_greedy_walk() -> None:
    ends = budget_ends(LENGTHS, BUDGET).tolist()
    assert ends == list(itertools.accumulate(len(b) for b in _greedy(LENGTHS.tolist(), BUDGET)))
    assert budget_ends(np.array([5, 5, 5]), 5).tolist() == [1, 2, 3]  # a sample filling it


@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.parametrize("drop_last", [False, True])
def test_one_epoch_every_sample_once_within_the_budget_and_equal_steps(world, drop_last) -> None:
    samplers = _samplers(world, drop_last=drop_last)
    batches = _lockstep(samplers)
    order = samplers[0].epoch_order().tolist()
    expected = [[order[p] for p in b] for b in _greedy(LENGTHS[order].tolist(), BUDGET)]
    steps = len(batches) // world
    assert all(_samplers(world, drop_last=drop_last)[r].steps() == steps for r in range(world))
    assert all(len(s) == (57 // world if drop_last else -(-57 // world)) for s in samplers)
    assert all(int(LENGTHS[b].sum()) <= BUDGET for b in batches)
    if drop_last:  # the last group short of `world` batches is left out, nothing repeats
        assert batches == expected[: len(expected) // world * world]
    else:  # completed with the epoch's first batches, as DistributedSampler repeats samples
        assert batches[: len(expected)] == expected
        assert batches[len(expected) :] == expected[: len(batches) - len(expected)]
        assert sorted(i for b in batches[: len(expected)] for i in b) == list(range(57))
    used = [i for b in batches for i in b]
    assert len(set(used)) == len(used) or not drop_last
    assert samplers[0].state_dict()["consumed"] == sum(len(b) for b in batches[: len(expected)])


@pytest.mark.parametrize(
    ("before", "after", "budget_after"),
    [(1, 1, 40), (2, 2, 40), (2, 1, 40), (1, 2, 40), (2, 3, 64)],
)
@pytest.mark.parametrize("steps", [1, 4])
def test_resume_continues_with_the_first_unused_sample(before, after, budget_after, steps) -> None:
    reference = _lockstep(_samplers(after, budget=budget_after))
    old = _samplers(before)
    taken = _lockstep(old, steps)
    states = [s.state_dict() for s in old]
    assert all(state == states[0] for state in states)  # every rank saves the same position
    consumed = states[0]["consumed"]
    order = old[0].epoch_order().tolist()
    assert sorted(i for b in taken for i in b) == sorted(order[:consumed])
    new = _samplers(after, budget=budget_after)
    for s in new:
        s.load_state_dict(states[0])
    rest = _lockstep(new)
    head = [i for b in taken for i in b]
    tail = [i for b in rest for i in b]
    epoch = head + tail[: 57 - len(head)]
    assert sorted(epoch) == list(range(57))  # nothing lost, nothing repeated in the epoch
    assert all(int(LENGTHS[b].sum()) <= budget_after for b in rest)
    if (before, BUDGET) == (after, budget_after):  # the uninterrupted run's very batches
        assert taken + rest == reference


def test_the_length_bounds_every_epoch_whose_steps_vary() -> None:
    """Each epoch's cuts differ; Lightning reads the length once and stops an epoch there, so
    it must bound them all."""
    s = TokenBudgetSampler(LENGTHS, 50, seed=3)
    counts = []
    for epoch in range(6):
        s.set_epoch(epoch)
        counts.append(len(list(s)))
    assert len(set(counts)) > 1 and max(counts) <= len(s) == 57


def test_a_position_saved_by_fixed_batches_is_continued_by_the_budget() -> None:
    [budget] = _samplers(1)
    budget.load_state_dict({"epoch": 0, "consumed": 10, "seed": 3, "num_samples": 57})
    order = budget.epoch_order().tolist()
    assert [i for b in budget for i in b] == order[10:]


def test_a_sample_longer_than_the_budget_is_refused_naming_the_key() -> None:
    with pytest.raises(ValueError, match=r"data\.max_token_len_per_gpu=20 .*sample 3: 25 tok"):
        TokenBudgetSampler(np.array([3, 4, 5, 25, 1]), 20)
    for bad in (0, -1, 2.5, True, None):
        with pytest.raises(ValueError, match=r"data\.max_token_len_per_gpu must be a positive"):
            TokenBudgetSampler(np.array([1]), bad)


# --------------------------------------------------------------------------- the data module


def _sft(path: Path, n: int = 40) -> Path:
    """SFT documents whose first token is their index (a batch row shows which samples it
    holds), of 3 to 22 tokens."""
    with H5Writer(path, dtypes={"input_ids": np.uint16, "loss_mask": np.uint8}) as w:
        for i in range(n):
            ids = np.concatenate([[i], np.arange(2 + (i * 7) % 20) % 250 + 60]).astype(np.uint16)
            w.add(input_ids=ids, loss_mask=(np.arange(len(ids)) % 2).astype(np.uint8))
    return path


def _module(path: Path, **kw) -> AstraiDataModule:
    options = dict(padding_free=True, use_dynamic_bsz=True, max_token_len_per_gpu=50, seed=4)
    return AstraiDataModule(
        {"_target_": "astrai.data.SFTDataset", "source": str(path)},
        **{
            **options,
            **kw,
        },
    )


def _samples(batch: dict[str, torch.Tensor]) -> list[int]:
    """The samples of a padding-free row: the first token of each (positions restart at 0)."""
    starts = batch["position_ids"][0] == 0
    return batch["input_ids"][0][starts].tolist()


@pytest.mark.parametrize("num_workers", [0, pytest.param(2, marks=pytest.mark.slow)])
def test_the_data_module_hands_over_budgeted_rows_and_resumes(tmp_path, num_workers) -> None:
    path = _sft(tmp_path / "sft.h5")
    lengths = SFTDataset(str(path)).token_lengths()
    assert lengths.tolist() == [1 + (i * 7) % 20 + 1 for i in range(40)]
    reference = [(_samples(b), b["input_ids"].shape) for b in _module(path).train_dataloader()]
    assert all(shape[0] == 1 and shape[1] <= 50 for _, shape in reference)
    assert sorted(i for ids, _ in reference for i in ids) == list(range(40))
    assert len({len(ids) for ids, _ in reference}) > 1  # the number of samples varies
    dm = _module(path, num_workers=num_workers)
    it = iter(dm.train_dataloader())
    head = [_samples(next(it)) for _ in range(3)]  # workers have prefetched further
    state = dm.state_dict()
    assert state["consumed"] == sum(len(ids) for ids in head)
    resumed = _module(path, num_workers=num_workers)
    resumed.load_state_dict(state)
    loader = resumed.train_dataloader()
    assert len(loader) == 40  # a bound no epoch reaches: one sample a batch (see __len__)
    assert head + [_samples(b) for b in loader] == [ids for ids, _ in reference]


def test_bad_settings_are_refused_naming_the_key(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"data\.use_dynamic_bsz=true .* needs data\.padding_fr"):
        AstraiDataModule(use_dynamic_bsz=True)
    with pytest.raises(ValueError, match=r"data\.use_dynamic_bsz must be true or false"):
        AstraiDataModule(padding_free=True, use_dynamic_bsz="yes")
    with pytest.raises(ValueError, match=r"data\.max_token_len_per_gpu must be a positive"):
        AstraiDataModule(padding_free=True, use_dynamic_bsz=True, max_token_len_per_gpu=0)
    dm = _module(_sft(tmp_path / "sft.h5"), max_token_len_per_gpu=12)
    with pytest.raises(ValueError, match=r"data\.max_token_len_per_gpu=12 .* 21 tokens"):
        dm.setup("fit")  # before the first step: at set-up


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["data.use_dynamic_bsz=true"], r"data\.use_dynamic_bsz=true .* needs data\.padding_free"),
        (["data.padding_free=true", "data.use_dynamic_bsz=1"], r"data\.use_dynamic_bsz must be"),
        (["data.max_token_len_per_gpu=0"], r"data\.max_token_len_per_gpu must be a positive"),
    ],
)
def test_the_preflight_refuses_bad_budget_settings_before_the_run(overrides, message) -> None:
    """`python -m astrai.train` checks the settings before a tokenizer, data or model exists."""
    from astrai.train import preflight
    from astrai.train.runner import compose

    found = preflight.problems(compose(["experiment=tiny_sft", *overrides]))
    assert len(found) == 1 and re.search(message, found[0]), found
    good = ["data.padding_free=true", "data.use_dynamic_bsz=true", "data.max_token_len_per_gpu=64"]
    assert preflight.problems(compose(["experiment=tiny_sft", *good])) == []
