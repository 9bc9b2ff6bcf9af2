"""On-policy preference pairs: sampled by the engine from a checkpoint, judged by a reward."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from astrai.data import AstraiDataModule, DataError, OnPolicyPairs
from astrai.data.builtin import write_builtin_jsonl
from astrai.data.rewards import REWARDS, get_reward, register_reward
from astrai.model import preset_model, save_pretrained
from astrai.tokenizer import AutoTokenizer


@register_reward("test_even_length")
def _even_length(record, completion: str) -> float:
    """Half of a random policy's completions earn it: every prompt yields a pair."""
    return float(len(completion) % 2 == 0)


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


def _pairs(policy: Path, prompts: Path, **kw) -> OnPolicyPairs:
    opts = dict(num_samples=4, max_tokens=6, reward="test_even_length", batch_size=5)
    opts.update(kw)
    return OnPolicyPairs(str(policy), str(prompts), **opts)


def test_pairs_are_judged_by_the_reward_and_reproducible(policy, prompts):
    source = _pairs(policy, prompts)
    records = list(source.records())
    assert records, "a random policy is right half of the time: pairs expected"
    reward = get_reward("test_even_length")
    asked = {json.loads(line)["prompt"] for line in prompts.read_text().splitlines()}
    for rec in records:
        assert rec["prompt"] in asked and "answer" in rec
        assert reward(rec, rec["chosen"]) == 1.0
        assert reward(rec, rec["rejected"]) == 0.0
    assert source.stats["pairs"] == len(records) <= 12
    assert 0.0 < source.stats["sample_accuracy"] < 1.0
    again = list(_pairs(policy, prompts).records())
    assert again == records  # seeded sampling: the same pairs every time
    other = list(_pairs(policy, prompts, seed=7).records())
    assert other != records


def test_samples_come_from_the_policy(policy, prompts, tok):
    """The completions are what the checkpoint generates: greedy-ish sampling at a tiny
    temperature reproduces the engine's greedy output for the same prompt."""
    source = _pairs(policy, prompts, temperature=1e-4, num_samples=2)
    sampled = source.sample()
    from astrai.inference import InferenceEngine
    from astrai.model import load_pretrained

    model = load_pretrained(policy, dtype=torch.float32).eval()
    record, texts, _ = sampled[0]
    ids = tok.apply_chat_template(
        [{"role": "user", "content": record["prompt"]}], add_generation_prompt=True, tokenize=True
    )
    engine = InferenceEngine(model, tok, start=False, max_batch_size=2, max_seq_len=64)
    try:
        greedy = engine.run_batch([list(ids)], max_tokens=6, temperature=0.0)[0]
    finally:
        engine.shutdown()
    assert texts[0] == tok.decode(greedy, skip_special_tokens=True)


def test_identity_follows_the_weights_and_options(policy, prompts, tmp_path, tok):
    a = _pairs(policy, prompts).identity()
    assert a == _pairs(policy, prompts).identity()
    assert a != _pairs(policy, prompts, temperature=0.7).identity()
    other = _export(tmp_path / "other", tok, seed=1)
    assert a["policy"] != _pairs(other, prompts).identity()["policy"]


def test_bad_options_fail_before_sampling(policy, prompts, tmp_path):
    with pytest.raises(FileNotFoundError, match="policy"):
        OnPolicyPairs(str(tmp_path / "missing"), str(prompts))
    with pytest.raises(ValueError, match="num_samples"):
        _pairs(policy, prompts, num_samples=1)
    with pytest.raises(ValueError, match="fallback"):
        _pairs(policy, prompts, fallback="gold")
    with pytest.raises(KeyError, match="unknown reward"):
        _pairs(policy, prompts, reward="nope")


def test_a_bad_sampling_option_fails_before_the_checkpoint_is_read(policy, prompts):
    with pytest.raises(ValueError, match=r"^OnPolicyPairs: top_p must be in \(0, 1\]"):
        _pairs(policy, prompts, top_p=0.0)


def test_no_pair_is_a_clear_error_unless_reference_fallback(policy, prompts):
    REWARDS["test_never"] = lambda record, completion: 0.0
    try:
        with pytest.raises(DataError, match="no preference pairs"):
            list(_pairs(policy, prompts, reward="test_never").records())
        records = list(_pairs(policy, prompts, reward="test_never", fallback="reference").records())
    finally:
        del REWARDS["test_never"]
    assert len(records) == 12
    assert all(r["chosen"].endswith(f"The answer is {r['answer']}.") for r in records)


def test_datamodule_prepares_on_policy_pairs_once(policy, prompts, tok_dir, tmp_path):
    spec = {
        "_target_": "astrai.data.PreferenceDataset",
        "source": {
            "_target_": "astrai.data.OnPolicyPairs",
            "policy": str(policy),
            "prompts": str(prompts),
            "num_samples": 4,
            "max_tokens": 6,
            "reward": "test_even_length",
        },
        "prepare": {"name": "pairs"},
    }
    dm = AstraiDataModule(train=dict(spec), batch_size=2)
    dm.connect(tok_dir, tmp_path / "data")
    dm.setup()
    ds = dm.datasets["train"]
    first = dm.prepared["train"].path
    assert 0 < len(ds) <= 12
    batch = next(iter(dm.train_dataloader()))
    assert {"chosen_input_ids", "rejected_input_ids"} <= set(batch)
    again = AstraiDataModule(train=dict(spec), batch_size=2)
    again.connect(tok_dir, tmp_path / "data")
    assert again.prepared["train"].path == first  # same checkpoint and options: cached
    spec["source"] = dict(spec["source"], seed=3)
    changed = AstraiDataModule(train=spec, batch_size=2)
    changed.connect(tok_dir, tmp_path / "data")
    assert changed.prepared["train"].path != first
