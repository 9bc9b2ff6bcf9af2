"""Unpaired (KTO) data: ``kind=unpaired`` records prepared and read back, bad labels refused
before training, the collate's mismatched KL rows, and on-policy thumbs-up/down samples."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest
import torch

from astrai.data import (
    IGNORE_INDEX,
    AstraiDataModule,
    DataError,
    OnPolicyPairs,
    OnPolicySamples,
    UnpairedDataset,
    collate_unpaired,
)
from astrai.data.builtin import write_builtin_jsonl
from astrai.data.prepare import prepare
from astrai.data.rewards import get_reward, register_reward
from astrai.model import preset_model, save_pretrained
from astrai.tokenizer import AutoTokenizer


@register_reward("test_unpaired_even_length")
def _even_length(record, completion: str) -> float:
    """Half of a random policy's completions earn it: both labels on most prompts."""
    return float(len(completion) % 2 == 0)


RECORDS = [
    {"prompt": "What is 2 + 3?", "completion": "The answer is 5.", "label": True},
    {
        "prompt": [{"role": "user", "content": "What is 7 - 4?"}],
        "completion": [{"role": "assistant", "content": "The answer is 2."}],
        "label": False,
    },
    {
        "prompt": [
            {"role": "user", "content": "What is 1 + 1?"},
            {"role": "assistant", "content": "The answer is 2."},
            {"role": "user", "content": "And 2 + 2?"},
        ],
        "completion": "The answer is 4.",
        "label": True,
    },
]


def _jsonl(path: Path, records: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return path


def _prepare(tmp_path: Path, tok: AutoTokenizer, records: list, **kw):
    src = _jsonl(tmp_path / "data.jsonl", records)
    return prepare("unpaired", src, tmp_path / "out", tok, progress=False, **kw)


def _messages(value, role):
    return [{"role": role, "content": value}] if isinstance(value, str) else value


# ------------------------------------------------------------------------------------ prepare


def test_prepare_round_trip(tmp_path, tok):
    result = _prepare(tmp_path, tok, RECORDS)
    assert result.documents == 3
    ds = UnpairedDataset(result.path, tokenizer_fingerprint=tok.fingerprint)
    assert len(ds) == 3 and ds.label_counts() == (2, 1)
    for i, record in enumerate(RECORDS):
        item = ds[i]
        prompt = _messages(record["prompt"], "user")
        full, mask = tok.encode_chat(prompt + _messages(record["completion"], "assistant"))
        head = tok.apply_chat_template(prompt, add_generation_prompt=True, tokenize=True)
        n = len(head)
        assert item["prompt_ids"].tolist() == list(head) == full[:n]
        assert item["completion_ids"].tolist() == full[n:]
        assert item["completion_mask"].tolist() == [bool(m) for m in mask[n:]]
        assert item["completion_mask"].any() and not item["completion_mask"].all()  # "\n"
        assert bool(item["label"]) is record["label"]
        # the earlier assistant turn of the multi-turn prompt is context, not scored
        assert tok.decode(item["completion_ids"][item["completion_mask"]].tolist()).startswith(
            _messages(record["completion"], "assistant")[0]["content"]
        )


@pytest.mark.parametrize(
    ("value", "shown"), [(1, "1"), ("yes", '"yes"'), (None, "null"), (0, "0"), ("true", '"true"')]
)
def test_a_label_that_is_not_a_boolean_is_refused(tmp_path, tok, value, shown):
    records = [RECORDS[0], {**RECORDS[0], "label": value}]
    with pytest.raises(DataError) as err:
        _prepare(tmp_path, tok, records)
    assert str(err.value) == (
        f"{tmp_path / 'data.jsonl'}:2: field 'label' must be true or false, got {shown}"
    )


@pytest.mark.parametrize("field", ["label", "completion", "prompt"])
def test_a_missing_field_is_named(tmp_path, tok, field):
    bad = {k: v for k, v in RECORDS[0].items() if k != field}
    with pytest.raises(
        DataError, match=rf"data\.jsonl:3: record is missing required field '{field}'"
    ):
        _prepare(tmp_path, tok, [RECORDS[0], RECORDS[1], bad])
    assert not (tmp_path / "out" / "data.h5").exists()


def test_a_prompt_that_fills_max_length_is_skipped_and_truncate_cuts_the_completion(tmp_path, tok):
    long = {"prompt": "What is 2 + 3?", "completion": "The answer is 5. " * 20, "label": True}
    head = tok.apply_chat_template(
        _messages(long["prompt"], "user"), add_generation_prompt=True, tokenize=True
    )
    limit = len(head) + 4
    result = _prepare(tmp_path, tok, [long], max_length=limit, truncate=True, name="cut")
    item = UnpairedDataset(result.path)[0]
    assert len(item["prompt_ids"]) == len(head) and len(item["completion_ids"]) == 4
    short = {"prompt": "Hi", "completion": "5", "label": False}
    skipped = _prepare(
        tmp_path, tok, [long, short], max_length=len(head), truncate=True, name="skip"
    )
    assert skipped.documents == 1 and skipped.skipped == {"too_long": 1}


# ------------------------------------------------------------------------------------ collate


def _item(prompt: list[int], completion: list[int], label: bool, mask: list[int] | None = None):
    return {
        "prompt_ids": torch.tensor(prompt),
        "completion_ids": torch.tensor(completion),
        "completion_mask": torch.tensor(mask or [1] * len(completion), dtype=torch.bool),
        "label": torch.tensor(label),
    }


def test_the_kl_rows_pair_each_prompt_with_the_previous_rows_completion():
    items = [
        _item([10, 11], [20, 21, 22], True),
        _item([12, 13, 14], [23], False, None),
        _item([15], [24, 25], True, [1, 0]),
    ]
    batch = collate_unpaired(items, pad_id=0)
    assert batch["label"].tolist() == [True, False, True] and batch["label"].dtype == torch.bool
    width = batch["input_ids"].shape[1]
    for key in ("labels", "loss_mask", "attention_mask", "position_ids"):
        assert batch[key].shape == batch[f"kl_{key}"].shape == (3, width)
    for i, item in enumerate(items):
        for prefix, donor in (("", item), ("kl_", items[i - 1])):  # row 0 takes the last
            expected = item["prompt_ids"].tolist() + donor["completion_ids"].tolist()
            n = len(expected) - 1
            row = {k: batch[f"{prefix}{k}"][i] for k in ("input_ids", "labels", "loss_mask")}
            assert row["input_ids"][:n].tolist() == expected[:-1]
            assert row["input_ids"][n:].eq(0).all()  # right padding
            p = len(item["prompt_ids"])
            scored = [False] * (p - 1) + donor["completion_mask"].tolist()
            assert row["loss_mask"][:n].tolist() == scored
            want = [t if s else IGNORE_INDEX for t, s in zip(expected[1:], scored)]
            assert row["labels"][:n].tolist() == want
            assert row["labels"][n:].eq(IGNORE_INDEX).all()
    assert batch["kl_input_ids"][0, :3].tolist() == [10, 11, 24]  # prompt 0 + completion 2
    assert batch["kl_labels"][0, :3].tolist() == [IGNORE_INDEX, 24, IGNORE_INDEX]


def test_one_row_is_its_own_kl_partner_and_max_length_cuts_both_rows():
    one = collate_unpaired([_item([3, 4], [5, 6], False)])
    assert torch.equal(one["kl_input_ids"], one["input_ids"])
    cut = collate_unpaired([_item([3, 4], [5, 6, 7], True), _item([8], [9], True)], max_length=3)
    assert cut["input_ids"].shape[1] == 3
    assert cut["kl_input_ids"][1].tolist() == [8, 5, 6]
    assert cut["kl_labels"][1].tolist() == [5, 6, 7]


def test_the_dataset_collates_what_prepare_wrote(tmp_path, tok):
    result = _prepare(tmp_path, tok, RECORDS)
    ds = UnpairedDataset(result.path)
    batch = ds.collate([ds[i] for i in range(3)])
    full = [ds[i]["prompt_ids"].tolist() + ds[i]["completion_ids"].tolist() for i in range(3)]
    kl = ds[2]["prompt_ids"].tolist() + ds[1]["completion_ids"].tolist()
    assert batch["input_ids"][0, : len(full[0]) - 1].tolist() == full[0][:-1]
    assert batch["kl_input_ids"][2, : len(kl) - 1].tolist() == kl[:-1]
    assert batch["input_ids"][0, len(full[0]) - 1 :].eq(ds.pad_id).all()


# ----------------------------------------------------------------------------------- on-policy


def _export(path: Path, tok: AutoTokenizer, seed: int = 0) -> Path:
    torch.manual_seed(seed)
    save_pretrained(preset_model("tiny", vocab_size=len(tok)), path, tokenizer=tok)
    return path


@pytest.fixture()
def policy(tmp_path: Path, tok: AutoTokenizer) -> Path:
    return _export(tmp_path / "policy", tok)


@pytest.fixture()
def prompts(tmp_path: Path) -> Path:
    path = tmp_path / "prompts.jsonl"
    write_builtin_jsonl("arithmetic/prompt", path, n=12, seed=0, max_operand=9, ops="+")
    return path


def _samples(policy: Path, prompts: Path, **kw) -> OnPolicySamples:
    opts = dict(num_samples=4, max_tokens=6, reward="test_unpaired_even_length", batch_size=5)
    opts.update(kw)
    return OnPolicySamples(str(policy), str(prompts), **opts)


def _by_prompt(records: list[dict]) -> dict[str, Counter]:
    out: dict[str, Counter] = {}
    for r in records:
        out.setdefault(r["id"].rsplit("-sample", 1)[0], Counter())[r["label"]] += 1
    return out


def test_on_policy_samples_are_labelled_by_the_reward_and_capped_evenly(policy, prompts):
    source = _samples(policy, prompts)
    records = list(source.records())
    assert len(records) == 12 * 4  # every sample
    reward = get_reward("test_unpaired_even_length")
    for r in records:
        assert set(r) >= {"prompt", "completion", "label", "answer"}
        assert r["label"] is (reward(r, r["completion"]) > 0)
    assert source.stats["desirable"] + source.stats["undesirable"] == len(records)
    assert 0 < source.stats["desirable"] < len(records)
    assert list(_samples(policy, prompts).records()) == records  # seeded

    capped = list(_samples(policy, prompts, max_per_prompt=2).records())
    full, kept = _by_prompt(records), _by_prompt(capped)
    assert set(kept) == set(full)
    for key, counts in full.items():
        good, bad = counts[True], counts[False]
        want = (1, 1) if good and bad else (min(good, 2), min(bad, 2))
        assert (kept[key][True], kept[key][False]) == want, key
    texts = Counter((r["id"].rsplit("-sample", 1)[0], r["completion"]) for r in records)
    assert not Counter((r["id"].rsplit("-sample", 1)[0], r["completion"]) for r in capped) - texts


def test_on_policy_identity_names_the_source_and_options(policy, prompts):
    a = _samples(policy, prompts).identity()
    assert a == _samples(policy, prompts).identity()
    assert a["on_policy"] == "OnPolicySamples" and a["threshold"] == 0.0
    assert a != _samples(policy, prompts, max_per_prompt=2).identity()
    assert a != _samples(policy, prompts, temperature=0.7).identity()
    pairs = OnPolicyPairs(str(policy), str(prompts), num_samples=4, reward="exact_match")
    assert set(pairs.identity()) == {  # unchanged by the shared base: its caches stay valid
        "on_policy",
        "policy",
        "prompts",
        "builtin",
        "num_samples",
        "sampling",
        "seed",
        "reward",
        "threshold",
        "pairs_per_prompt",
        "fallback",
    }
    assert pairs.identity()["on_policy"] == "OnPolicyPairs"
    assert pairs.identity()["policy"] == a["policy"]
    with pytest.raises(ValueError, match="max_per_prompt"):
        _samples(policy, prompts, max_per_prompt=0)
    with pytest.raises(ValueError, match=r"^OnPolicySamples: num_samples must be >= 1"):
        _samples(policy, prompts, num_samples=0)


def test_datamodule_prepares_on_policy_samples(policy, prompts, tok_dir, tmp_path):
    spec = {
        "_target_": "astrai.data.UnpairedDataset",
        "source": {
            "_target_": "astrai.data.OnPolicySamples",
            "policy": str(policy),
            "prompts": str(prompts),
            "num_samples": 2,
            "max_tokens": 6,
            "reward": "test_unpaired_even_length",
        },
        "prepare": {"name": "samples"},
    }
    dm = AstraiDataModule(train=dict(spec), batch_size=4)
    dm.connect(tok_dir, tmp_path / "data")
    dm.setup()
    assert len(dm.datasets["train"]) == 24
    batch = next(iter(dm.train_dataloader()))
    assert {"input_ids", "kl_input_ids", "kl_labels", "label"} <= set(batch)
    assert batch["label"].shape == (4,)
