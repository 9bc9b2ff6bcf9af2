"""Datasets and collate functions: windows, shifted labels, masks, padding."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from data_helpers import write_lines

from astrai.data.datasets import (
    IGNORE_INDEX,
    PreferenceDataset,
    PretrainDataset,
    PromptDataset,
    SFTDataset,
    collate_lm,
)
from astrai.data.prepare import prepare
from astrai.data.storage import DataError, FingerprintMismatchError, H5Writer


@pytest.fixture
def corpus(tmp_path: Path) -> tuple[Path, np.ndarray, list[int]]:
    """A pretrain storage of 3 documents with tokens 0..102 (so values equal positions)."""
    lengths = [40, 13, 50]
    flat = np.arange(sum(lengths))
    path = tmp_path / "corpus.h5"
    with H5Writer(
        path, dtypes={"input_ids": np.uint16}, attrs={"kind": "pretrain", "pad_token_id": 7}
    ) as w:
        start = 0
        for n in lengths:
            w.add(input_ids=flat[start : start + n])
            start += n
    return path, flat, lengths


def test_pretrain_windows_and_the_corpus_end(corpus) -> None:
    path, flat, _ = corpus
    ds = PretrainDataset(path, window_size=10)
    assert len(ds) == (103 - 11) // 10 + 1 == 10
    for i in range(len(ds)):
        item = ds[i]
        assert item["input_ids"].tolist() == flat[i * 10 : i * 10 + 10].tolist()
        assert item["labels"].tolist() == flat[i * 10 + 1 : i * 10 + 11].tolist()
    last = ds[-1]  # tokens 90..100: the tail 101, 102 cannot fill another window
    assert last["input_ids"][0] == 90 and last["labels"][-1] == 100
    exact = PretrainDataset(path, window_size=102)  # exactly window + 1 tokens
    assert len(exact) == 1 and exact[0]["labels"][-1] == 102
    with pytest.raises(IndexError):
        ds[len(ds)]


def test_pretrain_stride_overlaps(corpus) -> None:
    path, flat, _ = corpus
    ds = PretrainDataset(path, window_size=8, stride=3)
    assert len(ds) == (103 - 9) // 3 + 1
    assert ds[5]["input_ids"].tolist() == flat[15:23].tolist()
    end = ds[len(ds) - 1]
    assert int(end["labels"][-1]) <= 102


def test_pretrain_window_larger_than_corpus(corpus) -> None:
    path, _, _ = corpus
    with pytest.raises(DataError, match=r"corpus\.h5: window_size=103 needs 104 tokens.*has 103"):
        PretrainDataset(path, window_size=103)
    with pytest.raises(ValueError, match="stride"):
        PretrainDataset(path, window_size=4, stride=0)


def test_pretrain_position_ids_restart_at_documents(corpus) -> None:
    path, _, _ = corpus
    ds = PretrainDataset(path, window_size=20, stride=20, reset_position_ids=True)
    pos = ds[1]["position_ids"].tolist()  # tokens 20..39 then doc 2 starts at 40
    assert pos == list(range(20))
    pos = ds[2]["position_ids"].tolist()  # tokens 40..59: doc 2 (40..52), doc 3 from 53
    assert pos == list(range(13)) + list(range(7))
    assert ds.pad_id == 7  # read from the storage attributes


def test_collate_lm_pads_and_masks() -> None:
    batch = [
        {"input_ids": torch.tensor([5, 6, 7]), "labels": torch.tensor([6, 7, 8])},
        {"input_ids": torch.tensor([9]), "labels": torch.tensor([10])},
    ]
    out = collate_lm(batch, pad_id=0, pad_to_multiple_of=4)
    assert out["input_ids"].tolist() == [[5, 6, 7, 0], [9, 0, 0, 0]]
    assert out["labels"].tolist() == [[6, 7, 8, IGNORE_INDEX], [10] + [IGNORE_INDEX] * 3]
    assert out["attention_mask"].tolist() == [[1, 1, 1, 0], [1, 0, 0, 0]]
    assert out["position_ids"].tolist() == [[0, 1, 2, 3]] * 2


@pytest.fixture
def chat_file(tmp_path: Path) -> Path:
    return write_lines(
        tmp_path / "chat.jsonl",
        [
            {
                "messages": [
                    {"role": "user", "content": "What is 2 + 3?"},
                    {"role": "assistant", "content": "The answer is 5."},
                ]
            },
            {
                "messages": [
                    {"role": "system", "content": "Be brief."},
                    {"role": "user", "content": "Hi"},
                    {"role": "assistant", "content": "Hello!"},
                ]
            },
        ],
    )


def test_sft_labels_follow_the_loss_mask(tmp_path: Path, tok, chat_file: Path) -> None:
    prepare("sft", chat_file, tmp_path / "out", tok, progress=False)
    ds = SFTDataset(tmp_path / "out" / "chat.h5", tokenizer_fingerprint=tok)
    ids, mask = tok.encode_chat(
        [
            {"role": "user", "content": "What is 2 + 3?"},
            {"role": "assistant", "content": "The answer is 5."},
        ]
    )
    item = ds[0]
    assert item["input_ids"].tolist() == ids[:-1]
    expected = [t if m else IGNORE_INDEX for t, m in zip(ids[1:], mask[1:])]
    assert item["labels"].tolist() == expected
    assert tok.decode([t for t in item["labels"].tolist() if t != IGNORE_INDEX]) == (
        "The answer is 5.<|im_end|>"
    )
    batch = ds.collate([ds[0], ds[1]])
    assert batch["input_ids"].shape == batch["labels"].shape == batch["loss_mask"].shape
    assert ds.pad_id == tok.pad_token_id
    short = len(ds[1]["input_ids"])
    assert batch["input_ids"][1, short:].eq(tok.pad_token_id).all()
    assert batch["labels"][1, short:].eq(IGNORE_INDEX).all()
    truncated = SFTDataset(tmp_path / "out" / "chat.h5", max_length=5)
    assert len(truncated[0]["input_ids"]) == 5


def test_dataset_refuses_another_tokenizer(tmp_path: Path, tok, other_tok, chat_file) -> None:
    prepare("sft", chat_file, tmp_path / "out", tok, progress=False)
    with pytest.raises(FingerprintMismatchError, match=r"chat\.h5 was built with tokenizer"):
        SFTDataset(tmp_path / "out" / "chat.h5", tokenizer_fingerprint=other_tok)
    with pytest.raises(DataError, match="no key 'chosen_ids'"):
        PreferenceDataset(tmp_path / "out" / "chat.h5")


def test_preference_and_prompt_batches(tmp_path: Path, tok) -> None:
    pref = write_lines(
        tmp_path / "pref.jsonl",
        [
            {"prompt": "What is 2 + 3?", "chosen": "The answer is 5.", "rejected": "No."},
            {"prompt": "Hi", "chosen": "Hello there, friend!", "rejected": "Go away."},
        ],
    )
    prepare("preference", pref, tmp_path / "out", tok, progress=False)
    ds = PreferenceDataset(tmp_path / "out" / "pref.h5")
    batch = ds.collate([ds[0], ds[1]])
    assert batch["chosen_input_ids"].shape == batch["rejected_input_ids"].shape
    for side, text in (("chosen", "The answer is 5."), ("rejected", "No.")):
        labels = [t for t in ds[0][f"{side}_labels"].tolist() if t != IGNORE_INDEX]
        assert tok.decode(labels) == text + "<|im_end|>"

    prompts = write_lines(
        tmp_path / "prompts.jsonl",
        [{"prompt": "What is 2 + 3?", "answer": "5"}, {"prompt": "Hi", "answer": "0"}],
    )
    prepare("prompt", prompts, tmp_path / "out", tok, progress=False, required_fields=["answer"])
    pds = PromptDataset(tmp_path / "out" / "prompts.h5")
    batch = pds.collate([pds[0], pds[1]])
    assert batch["records"] == [
        {"prompt": "What is 2 + 3?", "answer": "5"},
        {"prompt": "Hi", "answer": "0"},
    ]
    rendered = tok.apply_chat_template(
        [{"role": "user", "content": "Hi"}], add_generation_prompt=True, tokenize=True
    )
    assert batch["prompt_ids"][1] == rendered
    n = batch["input_ids"].shape[1]
    assert batch["input_ids"][1, n - len(rendered) :].tolist() == rendered  # left padded
    assert batch["attention_mask"][1].tolist() == [0] * (n - len(rendered)) + [1] * len(rendered)


def test_datasets_read_token_jsonl(tmp_path: Path) -> None:
    path = write_lines(
        tmp_path / "ids.jsonl", [{"input_ids": list(range(i, i + 6))} for i in range(5)]
    )
    ds = PretrainDataset(path, window_size=4)
    flat = [t for i in range(5) for t in range(i, i + 6)]
    assert len(ds) == (30 - 5) // 4 + 1
    assert ds[3]["input_ids"].tolist() == flat[12:16]
