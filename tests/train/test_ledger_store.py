"""The ledger file (astrai.train.ledger_store): rows read back as written, a resume's cut."""

from __future__ import annotations

import pytest

from astrai.train.ledger import batch_digest, weights_digest
from astrai.train.ledger_store import LedgerFile


def _step(k: int) -> dict:
    return {
        "step": k,
        "loss": 1.0 / k,
        "micro_loss": [1.0 / k, 2.0 / k][: 1 + k % 2],
        "grad_norm": float(k),
        "lr": 1e-3,
        "weights_digest": f"{k:032x}",
        "rng_digest": "r" * 32,
        "batch_digest": "b" * 32,
        "epoch": 0,
        "sample_start": 4 * (k - 1),
        "sample_end": 4 * k,
        "sample_ids": list(range(10 * k, 10 * k + k)),
    }


def _rollout(seed: int, step: int, masks: bool) -> dict:
    return {
        "seed": seed,
        "step": step,
        "version": step,
        "prompts": [[1, 2], [1, 2, 3]],
        "completions": [[5, 6, 7], [8]],
        "logprobs": [[-0.1, -0.25, -1.5], [-0.75]],
        "truncated": [True, False],
        "rewards": [1.0, 0.5],
        "action_masks": [[1, 1, 0], [1]] if masks else None,
        "parts": {"exact_match": 0.75},
        "stats": {},
    }


def test_rows_read_back_as_written_and_a_resume_cuts_after_its_step(tmp_path):
    path = tmp_path / "ledger.h5"
    with LedgerFile(path, "a") as ledger:
        ledger.set_meta(world_size=1, data_fingerprint={"train": None})
        for k in (1, 2, 3):
            ledger.append_step(_step(k))
            ledger.append_rollout(_rollout(100 + k, k - 1, masks=k == 2))
    with LedgerFile(path) as ledger:
        assert ledger.steps == [1, 2, 3]
        assert ledger.meta["data_fingerprint"] == {"train": None}
        for k in (1, 2, 3):
            row = ledger.step(k)
            want = _step(k)
            assert {key: row[key] for key in want} == want
            got = ledger.rollout(100 + k)
            expected = _rollout(100 + k, k - 1, masks=k == 2)
            assert {key: got[key] for key in expected} == expected
        with pytest.raises(KeyError, match=r"step 7 is not in the ledger \(steps 1..3\)"):
            ledger.step(7)
    with LedgerFile(path, "a") as ledger:  # resumed from step 1's checkpoint
        ledger.truncate(1)
        assert ledger.steps == [1]
        with pytest.raises(KeyError):
            ledger.rollout(102)  # sampled at step 1: sampled again by the resumed run
        assert ledger.rollout(101)["completions"] == [[5, 6, 7], [8]]
        ledger.append_step(_step(2))
        ledger.append_rollout(_rollout(102, 1, masks=True))
        assert ledger.steps == [1, 2] and ledger.step(2)["sample_ids"] == _step(2)["sample_ids"]
        assert ledger.rollout(102)["action_masks"] == [[1, 1, 0], [1]]


def test_each_samples_source_is_kept_and_cut_with_its_step(tmp_path):
    """`sample_sources` (a mixture's `data.train.sources` index per sample) reads back and
    is cut by a resume; a row written without it says source 0 (one source)."""
    path = tmp_path / "ledger.h5"
    with LedgerFile(path, "a") as ledger:
        ledger.append_step(_step(1))
        ledger.append_step({**_step(2), "sample_sources": [2, 0]})
        ledger.append_step({**_step(3), "sample_sources": [1, 1, 2]})
        ledger.truncate(2)
        ledger.append_step({**_step(3), "sample_sources": [0, 2, 1]})
    with LedgerFile(path) as ledger:
        sources = [ledger.step(k)["sample_sources"] for k in (1, 2, 3)]
    assert sources == [[0], [2, 0], [0, 2, 1]]


def test_a_missing_or_foreign_file_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="train with ledger=true"):
        LedgerFile(tmp_path / "none.h5")
    bad = tmp_path / "bad.h5"
    bad.write_text("not h5")
    with pytest.raises(ValueError, match=r"bad\.h5: not a readable ledger"):
        LedgerFile(bad)


def test_digests_see_every_bit():
    import torch

    a = {"w": torch.tensor([1.0, 2.0]), "b": torch.tensor([3], dtype=torch.int64)}
    b = {"w": torch.tensor([1.0, 2.0]).nextafter(torch.tensor(3.0)), "b": a["b"]}
    assert weights_digest(a.items()) == weights_digest(dict(a).items())
    assert weights_digest(a.items()) != weights_digest(b.items())
    assert weights_digest(a.items()) != weights_digest({"v": a["w"], "b": a["b"]}.items())
    batch = {"input_ids": torch.arange(6).view(2, 3), "records": [{"answer": "7"}]}
    other = {"input_ids": torch.arange(6).view(2, 3), "records": [{"answer": "8"}]}
    assert batch_digest([batch]) == batch_digest([dict(batch)])
    assert batch_digest([batch]) != batch_digest([other])
