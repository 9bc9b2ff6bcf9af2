"""Weighted mixtures of training sources (astrai.data.mixture): the draws follow the weights,
the order is a function of the seed, the position resumes at any number of ranks, and bad
entries are refused naming ``data.train.sources[i]``."""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from torch.utils.data import Dataset

from astrai.data.datamodule import AstraiDataModule
from astrai.data.datasets import SFTDataset
from astrai.data.fingerprint import DataChangedError
from astrai.data.mixture import MixtureDataset, MixtureSampler, check_entries


class Tagged(Dataset):
    """Sample i of source `tag` is {"tag": tag, "idx": i}."""

    def __init__(self, tag: int, n: int) -> None:
        self.tag, self.n = tag, n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"tag": torch.tensor(self.tag), "idx": torch.tensor(i)}


def _mixture(sizes=(50, 30, 20), weights=(0.5, 0.3, 0.2), **options) -> MixtureDataset:
    parts = [Tagged(t, n) for t, n in enumerate(sizes)]
    return MixtureDataset(parts, list(weights), ["a", "b", "c"][: len(sizes)], **options)


def _pairs(batch: dict[str, torch.Tensor]) -> list[tuple[int, int]]:
    return list(zip(batch["tag"].tolist(), batch["idx"].tolist()))


def test_three_sources_draw_within_binomial_bounds_of_their_weights() -> None:
    n = 10_000
    mix = _mixture(num_samples=n)
    sampler = MixtureSampler(mix, seed=3)
    sources, _ = mix.locate(sampler.epoch_order(0).numpy())
    counts = np.bincount(sources, minlength=3)
    for p, count in zip((0.5, 0.3, 0.2), counts):
        sigma = math.sqrt(n * p * (1 - p))
        assert abs(count - n * p) < 4.5 * sigma, (counts, p)
    # the bound can fail: a 0.6/0.25/0.15 mixture's draws are far outside it
    skewed = MixtureSampler(_mixture(weights=(0.6, 0.25, 0.15), num_samples=n), seed=3)
    far = np.bincount(mix.locate(skewed.epoch_order(0).numpy())[0], minlength=3)
    assert abs(far[0] - n * 0.5) > 4.5 * math.sqrt(n * 0.25)


def test_weights_not_summing_to_one_are_normalized() -> None:
    a = MixtureSampler(_mixture(weights=(5, 3, 2), num_samples=500), seed=1)
    b = MixtureSampler(_mixture(weights=(0.5, 0.3, 0.2), num_samples=500), seed=1)
    assert a.mixture.weights == pytest.approx([0.5, 0.3, 0.2])
    assert torch.equal(a.epoch_order(0), b.epoch_order(0))


def test_with_replacement_a_source_is_read_whole_before_any_sample_repeats() -> None:
    mix = _mixture(num_samples=400)
    sampler = MixtureSampler(mix, seed=5)
    orders = [sampler.epoch_order(e).numpy() for e in range(3)]
    for s, size in enumerate(mix.sizes):
        reads = np.concatenate([mix.locate(o)[1][mix.locate(o)[0] == s] for o in orders])
        for start in range(0, len(reads) - size + 1, size):  # each full pass: a permutation
            assert sorted(reads[start : start + size]) == list(range(size))
    # offsets: what each source had drawn before the epoch, continued across epochs
    first = np.bincount(mix.locate(orders[0])[0], minlength=3)
    assert sampler.offsets(1).tolist() == first.tolist()


def test_without_replacement_no_sample_twice_in_an_epoch() -> None:
    mix = _mixture(num_samples=90, replacement=False)
    sampler = MixtureSampler(mix, seed=2)
    for epoch in range(2):
        order = sampler.epoch_order(epoch).tolist()
        assert len(set(order)) == len(order) == 90
    with pytest.raises(ValueError, match=r"data\.train\.num_samples=101.*at most once"):
        _mixture(num_samples=101, replacement=False)


def test_without_replacement_draws_as_torchs_weighted_random_sampler() -> None:
    """The sources of the first positions, over 600 seeds, against torch.multinomial
    without replacement over every sample (weight_s / len(s) each): the same means within
    4.5 standard errors; with replacement (0.9 of every position) they are far off."""
    sizes, weights, k, runs = (20, 60), (0.9, 0.1), 30, 600
    mix = MixtureDataset(
        [torch.zeros(n) for n in sizes], list(weights), num_samples=k, replacement=False
    )
    ours = np.array(
        [(MixtureSampler(mix, seed=s).source_sequence(0) == 0).numpy() for s in range(runs)]
    )
    per = torch.tensor([0.9 / 20] * 20 + [0.1 / 60] * 60, dtype=torch.float64)
    g = torch.Generator().manual_seed(0)
    ref = np.array(
        [
            (torch.multinomial(per, k, replacement=False, generator=g) < 20).numpy()
            for _ in range(runs)
        ]
    )
    for first in (5, 15, 30):
        a, b = ours[:, :first].sum(1), ref[:, :first].sum(1)
        se = math.sqrt((a.var() + b.var()) / runs)
        assert abs(a.mean() - b.mean()) < 4.5 * se, (first, a.mean(), b.mean())
    assert abs(ours.sum(1).mean() - 0.9 * k) > 4.5 * se  # not the with-replacement draw


def test_the_order_is_a_function_of_the_seed_and_the_epoch() -> None:
    one, two = MixtureSampler(_mixture(), seed=7), MixtureSampler(_mixture(), seed=7)
    two.epoch_order(2)  # computed out of turn: the same orders
    for e in range(3):
        assert torch.equal(one.epoch_order(e), two.epoch_order(e))
    assert not torch.equal(one.epoch_order(0), one.epoch_order(1))
    assert not torch.equal(one.epoch_order(0), MixtureSampler(_mixture(), seed=8).epoch_order(0))


class _Rank:
    training = True
    lightning_module = None

    def __init__(self, rank: int, world: int) -> None:
        self.global_rank, self.world_size = rank, world


def _module(world: int = 1, rank: int = 0, **options) -> AstraiDataModule:
    dm = AstraiDataModule(_mixture(**options), batch_size=4, seed=4, drop_last=True)
    if world > 1:
        dm.trainer = _Rank(rank, world)
    return dm


@pytest.mark.parametrize("replacement", [True, False])
def test_resume_at_another_number_of_ranks_continues_the_same_order(replacement: bool) -> None:
    """Two ranks take 3 steps; resumed on one rank, the samples are the uninterrupted
    run's, in its order; and the per-source counts are the offsets plus the draws."""
    reference = [p for b in _module(replacement=replacement).train_dataloader() for p in _pairs(b)]
    ranks = [_module(2, r, replacement=replacement) for r in range(2)]
    loaders = [iter(dm.train_dataloader()) for dm in ranks]
    seen: list[tuple[int, int]] = []
    for _ in range(3):
        step = []
        for dm, it in zip(ranks, loaders):
            batch = next(it)
            dm.on_before_batch_transfer(batch, 0)
            step.append(_pairs(batch))
        for i in range(4):  # rank r took positions r, r + 2, ...: interleave them back
            seen += [step[0][i], step[1][i]]
    state = ranks[0].state_dict()
    assert state == ranks[1].state_dict() and state["consumed"] == 24
    assert state["mixture"]["offsets"] == [0, 0, 0] and state["mixture"]["names"] == ["a", "b", "c"]
    counts = np.bincount([t for t, _ in seen], minlength=3).tolist()
    assert list(ranks[0].source_counts().values()) == counts
    single = _module(replacement=replacement)
    single.load_state_dict(state)
    seen += [p for b in single.train_dataloader() for p in _pairs(b)]
    assert seen == reference


def test_a_resume_into_the_second_epoch_keeps_the_sources_offsets(caplog) -> None:
    caplog.set_level(logging.INFO, "astrai.data.datamodule")
    dm = _module()
    it = iter(dm.train_dataloader())
    for _ in range(25):  # the whole first epoch
        next(it)
    reference = []
    for batch in dm.train_dataloader():  # the second epoch, uninterrupted
        reference += _pairs(batch)
    again = _module()
    it = iter(again.train_dataloader())
    for _ in range(25):
        next(it)
    later = iter(again.train_dataloader())
    head = _pairs(next(later)) + _pairs(next(later))
    state = again.state_dict()
    assert state["epoch"] == 1 and state["mixture"]["offsets"] != [0, 0, 0]
    a, b, c = state["mixture"]["offsets"]  # the log line at the epoch's start says them
    assert f"data.train.sources at epoch 1, sample 0: a {a}, b {b}, c {c} so far" in caplog.text
    resumed = _module()
    resumed.load_state_dict(state)
    tail = [p for b in resumed.train_dataloader() for p in _pairs(b)]
    assert head + tail == reference


def test_a_resume_with_other_weights_or_sources_is_refused() -> None:
    dm = _module()
    next(iter(dm.train_dataloader()))
    state = dm.state_dict()
    other = AstraiDataModule(_mixture(weights=(0.4, 0.4, 0.2)), batch_size=4, seed=4)
    other.load_state_dict(state)
    with pytest.raises(ValueError, match=r"data\.train\.sources: .*weights"):
        other.train_dataloader()
    fewer = AstraiDataModule(_mixture(sizes=(50, 30, 21)), batch_size=4, seed=4)
    fewer.load_state_dict(state)
    with pytest.raises(ValueError, match=r"data\.train\.sources: .*sizes"):
        fewer.train_dataloader()
    single = AstraiDataModule(Tagged(0, 100), batch_size=4, seed=4)
    single.load_state_dict(state)
    with pytest.raises(ValueError, match=r"a mixture of data\.train\.sources \['a', 'b', 'c'\]"):
        single.train_dataloader()
    one = AstraiDataModule(Tagged(0, 100), batch_size=4, seed=4)
    next(iter(one.train_dataloader()))
    plain = _module()
    plain.load_state_dict(one.state_dict())
    with pytest.raises(ValueError, match=r"for one training source, this run mixes"):
        plain.train_dataloader()


@pytest.mark.parametrize(
    ("entries", "message"),
    [
        ("data.jsonl", r"data\.train\.sources: must be a list"),
        ([], r"data\.train\.sources: empty"),
        (["a.jsonl"], r"data\.train\.sources\[0\]: must be a mapping"),
        ([{"source": "a", "weight": 1, "wieght": 2}], r"sources\[0\]: unknown key.*wieght"),
        ([{"source": "a", "weight": 1}, {"weight": 1}], r"sources\[1\]\.source: required"),
        ([{"source": "a"}], r"sources\[0\]\.weight: required"),
        ([{"source": "a", "weight": -1}], r"sources\[0\]\.weight: must be positive"),
        ([{"source": "a", "weight": "x"}], r"sources\[0\]\.weight: must be a number"),
        ([{"source": "a", "weight": 1, "kind": "preference"}], r"sources\[0\]\.kind: 'pref"),
        ([{"source": "a", "weight": 1, "kind": "chat"}], r"sources\[0\]\.kind: must be one"),
        ([{"source": "a", "weight": 1, "prepare": "x"}], r"sources\[0\]\.prepare: must be"),
        ([{"source": "a", "weight": 1, "name": "x/y"}], r"sources\[0\]\.name: must be a string"),
        (
            [{"source": "d/a.jsonl", "weight": 1}, {"source": "e/a.jsonl", "weight": 1}],
            r"sources\[1\]: name 'a' is also sources\[0\]'s",
        ),
    ],
)
def test_a_bad_entry_is_refused_naming_it(entries: object, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        check_entries("train", entries, "sft")


def test_an_empty_source_is_refused() -> None:
    with pytest.raises(ValueError, match=r"data\.train\.sources: \['b'\] hold no samples"):
        _mixture(sizes=(5, 0, 3))


def test_a_pretrain_split_may_mix_sft_storages_and_only_train_mixes() -> None:
    entries = check_entries(
        "train", [{"source": "builtin:x/y", "weight": 1, "kind": "sft"}], "pretrain"
    )
    assert entries[0]["name"] == "x_y"
    with pytest.raises(ValueError, match=r"data\.val\.sources: .*data\.train only"):
        check_entries("val", [{"source": "a", "weight": 1}], "sft")


def _mix_spec(**split: object) -> dict:
    return {
        "_target_": "astrai.data.SFTDataset",
        "sources": [
            {"source": "builtin:arithmetic/sft/train", "weight": 3, "name": "small"},
            {
                "source": "builtin:arithmetic/sft/train",
                "weight": 1,
                "name": "big",
                "prepare": {"builtin": {"n": 24, "seed": 5}},
            },
        ],
        "prepare": {"builtin": {"n": 12, "seed": 0}},
        **split,
    }


def test_connect_prepares_each_source_and_a_changed_one_is_named(tmp_path: Path, tok_dir) -> None:
    dm = AstraiDataModule(train=_mix_spec(num_samples=40), batch_size=4, seed=1)
    dm.connect(tok_dir, tmp_path)
    assert sorted(dm.prepared) == ["train.sources[0]", "train.sources[1]"]
    dm.setup("fit")
    mix = dm.datasets["train"]
    assert isinstance(mix, MixtureDataset) and mix.sizes == [12, 24] and len(mix) == 36
    assert mix.num_samples == 40 and all(isinstance(d, SFTDataset) for d in mix.datasets)
    batch = next(iter(dm.train_dataloader()))
    assert batch["input_ids"].shape[0] == 4
    fingerprint = dm.data_fingerprint()
    assert set(fingerprint) == {"train.sources[0]", "train.sources[1]", "val", "test"}
    state = dm.state_dict()
    state["fingerprint"]["train.sources[1]"][0]["digest"] = "0" * 32
    again = AstraiDataModule(train=_mix_spec(num_samples=40), batch_size=4, seed=1)
    again.connect(tok_dir, tmp_path)
    again.setup("fit")
    with pytest.raises(DataChangedError, match=r"data\.train\.sources\[1\]: .*big"):
        again.load_state_dict(state)


def test_sources_to_prepare_without_connect_is_a_clear_error() -> None:
    with pytest.raises(
        ValueError, match=r"data\.train: its sources have prepare: blocks; call connect"
    ):
        AstraiDataModule(train=_mix_spec()).setup()


def test_a_split_with_source_and_sources_is_refused(tmp_path: Path, tok_dir) -> None:
    spec = _mix_spec(source="builtin:arithmetic/sft/train")
    with pytest.raises(ValueError, match=r"data\.train: give either source or sources"):
        AstraiDataModule(train=spec).connect(tok_dir, tmp_path)
    with pytest.raises(ValueError, match=r"data\.train\.replacement: must be true or false"):
        AstraiDataModule(train=_mix_spec(replacement="no")).connect(tok_dir, tmp_path)


def test_a_source_s_own_format_reads_its_layout(tmp_path: Path, tok_dir) -> None:
    """Sources of one mixture in different layouts and files: an entry's `prepare: {format:
    alpaca}` reads Alpaca records from a parquet file into the same documents as the
    equivalent `messages` records from JSONL."""
    rows = [(f"add {i} and {i + 1}", str(2 * i + 1)) for i in range(6)]
    chat, alpaca = tmp_path / "chat.jsonl", tmp_path / "alpaca.parquet"
    chat.write_text(
        "".join(
            json.dumps(
                {"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]}
            )
            + "\n"
            for q, a in rows
        )
    )
    alpaca_rows = [{"instruction": q, "input": "", "output": a} for q, a in rows]
    pq.write_table(pa.Table.from_pylist(alpaca_rows), alpaca)
    spec = {
        "_target_": "astrai.data.SFTDataset",
        "sources": [
            {"source": str(chat), "weight": 1, "name": "chat"},
            {"source": str(alpaca), "weight": 1, "name": "alpaca", "prepare": {"format": "alpaca"}},
        ],
        "prepare": {},
    }
    dm = AstraiDataModule(train=spec, batch_size=2, seed=0)
    dm.connect(tok_dir, tmp_path / "cache")
    dm.setup("fit")
    chat_ds, alpaca_ds = dm.datasets["train"].datasets
    assert len(chat_ds) == len(alpaca_ds) == 6
    for i in range(6):
        for key in ("input_ids", "labels"):
            assert torch.equal(chat_ds[i][key], alpaca_ds[i][key]), (i, key)
