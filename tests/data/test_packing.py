"""Packing (astrai.data.packing): best-fit decreasing against TRL's, greedy vs BFD through
prepare, and truncation_mode."""

from __future__ import annotations

from collections import Counter
from itertools import pairwise
from pathlib import Path

import numpy as np
import pytest
import torch
from data_helpers import write_lines

from astrai.data.datasets import collate_lm
from astrai.data.flatten import flatten_lm
from astrai.data.packing import bfd_bins, greedy_bins, padding_fraction
from astrai.data.prepare import prepare
from astrai.data.storage import DataError, H5Storage


def _trl_bfd_bins(lengths: list[int], capacity: int) -> list[list[int]]:
    """TRL's own best-fit decreasing windows: document i's tokens all carry the value i + 1."""
    from datasets import Dataset
    from trl.data_utils import pack_dataset

    ds = Dataset.from_dict({"input_ids": [[i + 1] * n for i, n in enumerate(lengths)]})
    packed = pack_dataset(ds, capacity, strategy="bfd", map_kwargs={"batch_size": len(ds)})
    bins = []
    for row in packed:
        cuts = np.cumsum([0, *row["seq_lengths"]])
        bins.append([row["input_ids"][a] - 1 for a in cuts[:-1]])
    return bins


def test_bfd_bins_are_trls() -> None:
    rng = np.random.default_rng(0)
    for capacity, lengths in [
        (64, rng.integers(1, 65, 300).tolist()),
        (512, np.minimum(rng.pareto(1.2, 500) * 20 + 1, 512).astype(int).tolist()),
        (10, [5, 5, 5, 3, 3, 2, 10, 1, 1, 1, 7, 3]),  # ties: input order among equals
    ]:
        assert bfd_bins(lengths, capacity) == _trl_bfd_bins(lengths, capacity)


def test_bins_cover_every_document_once_and_fit() -> None:
    rng = np.random.default_rng(1)
    lengths = rng.integers(1, 100, 400).tolist()
    for bins in (greedy_bins(lengths, 100), bfd_bins(lengths, 100)):
        assert sorted(i for b in bins for i in b) == list(range(len(lengths)))
        assert all(sum(lengths[i] for i in b) <= 100 for b in bins)
    assert greedy_bins([3, 4, 2, 5], 7) == [[0, 1], [2, 3]]
    assert padding_fraction([3, 4, 2, 5], [[0, 1], [2, 3]], 7) == 0.0
    assert padding_fraction([3, 4, 2], [[0, 1], [2]], 7) == pytest.approx(1 - 9 / 14)
    with pytest.raises(ValueError, match="more than the window"):
        bfd_bins([3, 9], 8)


def _chats(n: int, seed: int) -> list[dict]:
    """Chats whose lengths are long-tailed: mostly short answers, a few long ones."""
    rng = np.random.default_rng(seed)
    words = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta", "iota"]
    out = []
    for i in range(n):
        k = int(min(rng.pareto(1.0) * 4 + 1, 60))
        answer = " ".join(words[(i + j) % len(words)] for j in range(k))
        out.append(
            {
                "messages": [
                    {"role": "user", "content": f"question {i}"},
                    {"role": "assistant", "content": answer},
                ]
            }
        )
    return out


def _documents(storage: H5Storage) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """The (ids, loss mask) of every document of packed windows, cut where positions restart."""
    docs = []
    for w in range(len(storage)):
        ids, mask = storage.get("input_ids", w), storage.get("loss_mask", w)
        pos = storage.get("position_ids", w)
        starts = [*np.flatnonzero(pos == 0).tolist(), len(pos)]
        assert starts[0] == 0 and (np.diff(pos)[pos[1:] != 0] == 1).all()
        for a, b in pairwise(starts):
            docs.append((tuple(ids[a:b].tolist()), tuple(mask[a:b].tolist())))
    return docs


def test_bfd_packs_the_same_documents_as_greedy_with_less_padding(tmp_path: Path, tok) -> None:
    path = write_lines(tmp_path / "chat.jsonl", _chats(120, seed=0))
    window = 160
    common = {"progress": False, "pack": True, "window_size": window}
    plain = prepare("sft", path, tmp_path / "plain", tok, progress=False, max_length=window)
    greedy = prepare("sft", path, tmp_path / "greedy", tok, **common)
    bfd = prepare("sft", path, tmp_path / "bfd", tok, packing_strategy="bfd", **common)
    unpacked = H5Storage(tmp_path / "plain" / "chat.h5")
    g, b = H5Storage(tmp_path / "greedy" / "chat.h5"), H5Storage(tmp_path / "bfd" / "chat.h5")
    originals = Counter(
        (tuple(unpacked.get("input_ids", i).tolist()), tuple(unpacked.get("loss_mask", i).tolist()))
        for i in range(len(unpacked))
    )
    assert Counter(_documents(g)) == originals == Counter(_documents(b))
    tokens = Counter(np.concatenate([g.get("input_ids", i) for i in range(len(g))]).tolist())
    assert tokens == Counter(
        np.concatenate([b.get("input_ids", i) for i in range(len(b))]).tolist()
    )
    assert plain.tokens == greedy.tokens == bfd.tokens
    assert plain.documents == greedy.documents == bfd.documents > 100
    assert all(len(b.get("input_ids", i)) <= window for i in range(len(b)))
    # fewer windows of the same tokens: fewer padding tokens when windows pad to the window
    assert bfd.windows == len(b) < greedy.windows == len(g)
    assert len(b) * window - bfd.tokens < len(g) * window - greedy.tokens
    # the windows are TRL's best-fit decreasing of the documents in input order
    lengths = [len(unpacked.get("input_ids", i)) for i in range(len(unpacked))]
    order = [unpacked.get("input_ids", i).tolist() for i in range(len(unpacked))]
    expected = [
        np.concatenate([order[i] for i in window_docs]).tolist()
        for window_docs in _trl_bfd_bins(lengths, window)
    ]
    assert [b.get("input_ids", i).tolist() for i in range(len(b))] == expected


def test_bfd_packs_within_each_shard(tmp_path: Path, tok) -> None:
    path = write_lines(tmp_path / "chat.jsonl", _chats(50, seed=1))
    common = {"progress": False, "shard_size": 20, "max_length": 128}
    prepare("sft", path, tmp_path / "plain", tok, **common)
    prepare(
        "sft",
        path,
        tmp_path / "bfd",
        tok,
        pack=True,
        window_size=128,
        packing_strategy="bfd",
        **common,
    )
    shards = sorted((tmp_path / "bfd" / "chat").glob("*.h5"))
    plain = sorted((tmp_path / "plain" / "chat").glob("*.h5"))
    assert len(shards) == len(plain) == 3
    for packed_shard, plain_shard in zip(shards, plain):
        p = H5Storage(plain_shard)
        docs = Counter(
            (tuple(p.get("input_ids", i).tolist()), tuple(p.get("loss_mask", i).tolist()))
            for i in range(len(p))
        )
        assert Counter(_documents(H5Storage(packed_shard))) == docs


CHAT = [
    {"role": "user", "content": "Count from one to twelve."},
    {"role": "assistant", "content": "one two three four five six seven eight nine ten eleven"},
]


def test_truncation_mode_keep_end_keeps_the_last_tokens(tmp_path: Path, tok) -> None:
    path = write_lines(tmp_path / "c.jsonl", [{"messages": CHAT}])
    prepare("sft", path, tmp_path / "full", tok, progress=False)
    full = H5Storage(tmp_path / "full" / "c.h5")
    ids, mask = full.get("input_ids", 0).tolist(), full.get("loss_mask", 0).tolist()
    cut = len(ids) - 7
    for mode, keep in (("keep_start", slice(None, cut)), ("keep_end", slice(-cut, None))):
        prepare(
            "sft",
            path,
            tmp_path / mode,
            tok,
            progress=False,
            max_length=cut,
            truncate=True,
            truncation_mode=mode,
        )
        out = H5Storage(tmp_path / mode / "c.h5")
        assert out.get("input_ids", 0).tolist() == ids[keep]
        assert out.get("loss_mask", 0).tolist() == mask[keep]
    assert H5Storage(tmp_path / "keep_end" / "c.h5").get("input_ids", 0).tolist()[-1] == ids[-1]


def test_truncation_mode_keep_end_for_preference_and_unpaired(tmp_path: Path, tok) -> None:
    pair = {"prompt": CHAT[0]["content"], "chosen": CHAT[1]["content"], "rejected": "no."}
    path = write_lines(tmp_path / "p.jsonl", [pair])
    prepare("preference", path, tmp_path / "full", tok, progress=False)
    full = H5Storage(tmp_path / "full" / "p.h5").get("chosen_ids", 0).tolist()
    prepare(
        "preference",
        path,
        tmp_path / "end",
        tok,
        progress=False,
        max_length=len(full) - 3,
        truncate=True,
        truncation_mode="keep_end",
    )
    out = H5Storage(tmp_path / "end" / "p.h5")
    assert out.get("chosen_ids", 0).tolist() == full[3:]
    assert len(out.get("rejected_ids", 0)) < len(full) - 3  # the short side is left whole

    record = {"prompt": CHAT[0]["content"], "completion": CHAT[1]["content"], "label": True}
    path = write_lines(tmp_path / "u.jsonl", [record])
    prepare("unpaired", path, tmp_path / "ufull", tok, progress=False)
    u = H5Storage(tmp_path / "ufull" / "u.h5")
    prompt, completion = u.get("prompt_ids", 0).tolist(), u.get("completion_ids", 0).tolist()
    prepare(
        "unpaired",
        path,
        tmp_path / "uend",
        tok,
        progress=False,
        max_length=len(prompt) + len(completion) - 2,
        truncate=True,
        truncation_mode="keep_end",
    )
    cut = H5Storage(tmp_path / "uend" / "u.h5")
    assert cut.get("prompt_ids", 0).tolist() == prompt[2:]  # the prompt's start went
    assert cut.get("completion_ids", 0).tolist() == completion


def test_bad_packing_options_are_refused(tmp_path: Path, tok) -> None:
    path = write_lines(tmp_path / "c.jsonl", [{"messages": CHAT}])
    cases = [
        ({"pack": True, "window_size": 64, "packing_strategy": "wrapped"}, "packing_strategy"),
        ({"packing_strategy": "bfd"}, "packing_strategy=bfd needs pack=true"),
        ({"max_length": 8, "truncate": True, "truncation_mode": "left"}, "truncation_mode"),
        ({"max_length": 8, "truncation_mode": "keep_end"}, "needs truncate=true"),
    ]
    for options, message in cases:
        with pytest.raises(DataError, match=message):
            prepare("sft", path, tmp_path / "x", tok, progress=False, **options)
    assert not (tmp_path / "x").exists()


def _window(lengths: list[int]) -> dict:
    """An SFT sample of packed documents of these lengths (after the shift)."""
    n = sum(lengths)
    return {
        "input_ids": torch.arange(n),
        "labels": torch.arange(n),
        "loss_mask": torch.ones(n, dtype=torch.bool),
        "position_ids": torch.cat([torch.arange(k) for k in lengths]),
    }


def test_collated_packed_windows_carry_cu_seqlens() -> None:
    batch = collate_lm([_window([3, 4]), _window([5]), _window([2, 2, 2])], pad_id=0)
    assert batch["input_ids"].shape == (3, 7)
    # row 0: 3, 4; row 1: 5 and its padding tail (2); row 2: 2, 2, 2 and a tail of 1
    assert batch["cu_seqlens"].dtype == torch.int32
    assert batch["cu_seqlens"].tolist() == [0, 3, 7, 12, 14, 16, 18, 20, 21]
    assert "cu_seqlens" not in collate_lm([_window([5]), _window([3])], pad_id=0)  # unpacked
    flat = flatten_lm(batch)  # padding-free: the row's documents, no padding tails
    assert flat["cu_seqlens"].tolist() == [0, 3, 7, 12, 14, 16, 18]


def test_packing_strategy_enters_the_output_signature(tmp_path: Path, tok) -> None:
    path = write_lines(tmp_path / "chat.jsonl", _chats(30, seed=2))
    common = {"progress": False, "pack": True, "window_size": 128}
    prepare("sft", path, tmp_path / "out", tok, **common)
    again = prepare("sft", path, tmp_path / "out", tok, **common)  # the same: reused
    assert again.shards_reused == 1 and again.shards_written == 0
    with pytest.raises(DataError, match="prepared from other input or options"):
        prepare("sft", path, tmp_path / "out", tok, packing_strategy="bfd", **common)
    bfd = prepare(
        "sft", path, tmp_path / "out", tok, packing_strategy="bfd", overwrite=True, **common
    )
    assert bfd.shards_written == 1
