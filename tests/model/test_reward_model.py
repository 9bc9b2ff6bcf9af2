"""Reward-model directories against transformers: our export loads as
``AutoModelForSequenceClassification`` and its scores equal ours (dense right-padded batch
and our padding-free packed batch); transformers' own export loads here; a causal-LM
directory is refused naming ``score.weight``."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open

from astrai.model import CheckpointError, load_pretrained
from astrai.model.reward import (
    SCORE_KEY,
    RewardModel,
    last_token_rewards,
    load_reward_model,
    pack_sequences,
    render_for_reward,
    save_reward_model,
    score_sequences,
)
from astrai.tokenizer import AutoTokenizer

transformers = pytest.importorskip("transformers")

PAIRS = [
    ("What is 2 + 3?", "5"),
    (
        [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Name a fruit."}],
        "An apple, which is red or green.",
    ),
    ("Say hi", "hi"),
    ("Count to five, please, slowly.", "one two three four five"),
]


@pytest.fixture(scope="module")
def causal_dir(tmp_path_factory, build_model_dir):
    texts = [f"{p if isinstance(p, str) else p[-1]['content']} {c}" for p, c in PAIRS] * 20
    return build_model_dir(
        tmp_path_factory.mktemp("causal"),
        texts,
        vocab_size=300,
        num_hidden_layers=2,
        num_key_value_heads=1,
        initializer_range=0.2,
    )


@pytest.fixture(scope="module")
def reward_dir(causal_dir, tmp_path_factory):
    torch.manual_seed(0)
    model = RewardModel.from_backbone(load_pretrained(causal_dir, dtype=torch.float32))
    tok = AutoTokenizer.from_pretrained(causal_dir)
    return save_reward_model(model, tmp_path_factory.mktemp("reward") / "rm", tokenizer=tok)


def _sequences(path) -> list[list[int]]:
    tok = AutoTokenizer.from_pretrained(path)
    return [render_for_reward(tok, p, c) for p, c in PAIRS]


def _hf_scores(path, sequences: list[list[int]]) -> torch.Tensor:
    hf = transformers.AutoModelForSequenceClassification.from_pretrained(path).eval()
    pad = hf.config.pad_token_id
    n = max(len(s) for s in sequences)
    ids = torch.full((len(sequences), n), pad)
    attn = torch.zeros(len(sequences), n, dtype=torch.long)
    for i, s in enumerate(sequences):
        ids[i, : len(s)] = torch.tensor(s)
        attn[i, : len(s)] = 1
    with torch.no_grad():
        return hf(input_ids=ids, attention_mask=attn).logits.squeeze(-1)


def test_export_is_a_transformers_reward_model(reward_dir, causal_dir):
    config = json.loads((reward_dir / "config.json").read_text())
    tok = AutoTokenizer.from_pretrained(causal_dir)
    assert config["architectures"] == ["LlamaForSequenceClassification"]
    assert config["num_labels"] == 1 and config["id2label"] == {"0": "LABEL_0"}
    assert config["pad_token_id"] == tok.pad_token_id is not None
    with safe_open(str(reward_dir / "model.safetensors"), framework="pt") as f:
        keys = set(f.keys())
    assert SCORE_KEY in keys and "lm_head.weight" not in keys
    assert all(k == SCORE_KEY or k.startswith("model.") for k in keys)
    assert (reward_dir / "tokenizer.json").is_file()
    hf = transformers.AutoModelForSequenceClassification.from_pretrained(reward_dir)
    assert hf.config.num_labels == 1 and type(hf).__name__ == "LlamaForSequenceClassification"


def test_scores_equal_transformers_dense_and_packed(reward_dir):
    sequences = _sequences(reward_dir)
    tok = AutoTokenizer.from_pretrained(reward_dir)
    assert all(tok.pad_token_id not in s for s in sequences)
    theirs = _hf_scores(reward_dir, sequences)
    assert theirs.abs().max() > 1e-2  # not a degenerate all-zero head
    model = load_reward_model(reward_dir)
    # packed: padding-free rows of several sequences, several packs
    budget = len(sequences[0]) + len(sequences[1])
    packs = pack_sequences([len(s) for s in sequences], budget)
    assert len(packs) > 1 and len(packs[0]) == 2
    packed = torch.tensor(score_sequences(model, sequences, max_batch_tokens=budget))
    torch.testing.assert_close(packed, theirs, atol=1e-5, rtol=0)
    one_pack = torch.tensor(score_sequences(model, sequences, max_batch_tokens=10_000))
    torch.testing.assert_close(one_pack, theirs, atol=1e-5, rtol=0)
    # dense: the same right-padded batch transformers got
    n = max(len(s) for s in sequences)
    ids = torch.full((len(sequences), n), tok.pad_token_id)
    for i, s in enumerate(sequences):
        ids[i, : len(s)] = torch.tensor(s)
    last = torch.tensor([len(s) - 1 for s in sequences])
    with torch.no_grad():
        dense = last_token_rewards(model, ids, last)
    torch.testing.assert_close(dense, theirs, atol=1e-5, rtol=0)


def test_round_trip_and_transformers_export_load(reward_dir, tmp_path):
    ours = load_reward_model(reward_dir)
    again = save_reward_model(ours, tmp_path / "again", tokenizer=None)
    back = load_reward_model(again)
    for key, value in ours.state_dict().items():
        torch.testing.assert_close(back.state_dict()[key], value, atol=0, rtol=0)
    # a directory transformers wrote (as TRL's RewardTrainer saves it) loads here too
    hf = transformers.AutoModelForSequenceClassification.from_pretrained(reward_dir)
    with torch.no_grad():
        hf.score.weight.mul_(-2.0)
    hf.save_pretrained(tmp_path / "hf")
    sequences = _sequences(reward_dir)
    theirs = _hf_scores(tmp_path / "hf", sequences)
    mine = torch.tensor(score_sequences(load_reward_model(tmp_path / "hf"), sequences))
    torch.testing.assert_close(mine, theirs, atol=1e-5, rtol=0)


def test_a_causal_lm_directory_is_refused_naming_score_weight(causal_dir, tmp_path):
    with pytest.raises(CheckpointError, match=r"score\.weight") as info:
        load_reward_model(causal_dir)
    assert str(causal_dir) in str(info.value) and "lm_head" in str(info.value)
    with pytest.raises(CheckpointError, match="not found"):
        load_reward_model(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match=r"model\.safetensors"):
        load_reward_model(tmp_path / "empty")


def test_reward_model_has_no_lm_head_and_refuses_to_generate(reward_dir):
    model = load_reward_model(reward_dir)
    assert not hasattr(model, "lm_head")
    assert model(torch.tensor([[3, 4, 5]])).shape == (1, 3)
    with pytest.raises(TypeError, match="does not generate"):
        model.forward_packed(None, None, None)
