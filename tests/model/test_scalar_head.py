"""The machinery reward and value models share (`astrai.model.scalar_head`): the head's
bias follows the class, ``from_backbone`` shares or copies the blocks, a head tensor may be
absent only where the caller allows it, a head of two labels is refused naming the tensor,
unmerged LoRA adapters are refused, and the pad id follows tokenizer, then model, then EOS.
transformers parity lives in test_reward_model.py and test_value_model.py."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from astrai.model import CheckpointError, LoRAConfig, ModelConfig, Transformer, inject_lora
from astrai.model.scalar_head import (
    SCORE_BIAS_KEY,
    SCORE_KEY,
    ScalarHeadModel,
    head_config_to_hf,
    load_head_model,
    pad_token_id_for,
    save_head_model,
    stored_tensor_names,
)

CONFIG = ModelConfig(
    vocab_size=64,
    hidden_size=16,
    intermediate_size=32,
    num_hidden_layers=1,
    num_attention_heads=2,
    max_position_embeddings=32,
    eos_token_id=3,
)


class Biased(ScalarHeadModel):
    score_bias = True


def _save(model: ScalarHeadModel, path, task: str = "TokenClassification"):
    config = head_config_to_hf(model.config, task)
    return save_head_model(model, path, config, tokenizer=None, dtype=None, max_shard_size="2GB")


def test_the_head_follows_the_class_and_from_backbone_shares_or_copies():
    torch.manual_seed(0)
    policy = Transformer(CONFIG)
    plain, biased = ScalarHeadModel(CONFIG), Biased(CONFIG)
    assert plain.score.bias is None and torch.equal(biased.score.bias, torch.zeros(1))
    shared = Biased.from_backbone(policy)
    copied = Biased.from_backbone(policy, copy_blocks=True)
    assert shared.embed_tokens is policy.embed_tokens and shared.layers is policy.layers
    assert copied.embed_tokens is not policy.embed_tokens
    assert torch.equal(copied.embed_tokens.weight, policy.embed_tokens.weight)
    assert copied.config is not policy.config and copied.config == policy.config
    assert "lm_head.weight" not in copied.state_dict()


def test_absent_head_tensors_only_where_allowed(tmp_path):
    torch.manual_seed(0)
    model = ScalarHeadModel(CONFIG)  # stores score.weight only
    path = _save(model, tmp_path / "m", "SequenceClassification")
    assert stored_tensor_names(path) >= {SCORE_KEY, "model.embed_tokens.weight"}
    with pytest.raises(CheckpointError, match=r"missing tensors: score\.bias"):
        load_head_model(Biased, path)
    loaded, absent = load_head_model(Biased, path, optional=frozenset({SCORE_BIAS_KEY}))
    assert absent == {SCORE_BIAS_KEY}
    assert torch.equal(loaded.score.weight, model.score.weight)
    assert loaded.score.bias.device.type == "cpu" and loaded.score.bias.shape == (1,)
    back, absent = load_head_model(ScalarHeadModel, path)
    assert absent == set() and torch.equal(back.score.weight, model.score.weight)


def test_a_head_of_two_labels_is_refused_naming_the_tensor(tmp_path):
    model = Biased(CONFIG)
    model.score = torch.nn.Linear(CONFIG.hidden_size, 2)
    path = _save(model, tmp_path / "two")
    with pytest.raises(CheckpointError, match=r"score\.weight has shape \(2, 16\)") as info:
        load_head_model(Biased, path)
    assert str(path) in str(info.value)


def test_unmerged_lora_is_refused(tmp_path):
    model = Biased(CONFIG)
    inject_lora(model, LoRAConfig(r=2, lora_alpha=4))
    with pytest.raises(ValueError, match="merge_lora"):
        _save(model, tmp_path / "lora")
    assert not (tmp_path / "lora" / "model.safetensors").exists()


class _Tok:
    def __init__(self, pad: int | None, eos: int | None) -> None:
        self.pad_token_id, self.eos_token_id = pad, eos


def test_pad_id_order():
    model = ScalarHeadModel(CONFIG)
    assert pad_token_id_for(model, _Tok(7, 9)) == 7
    assert pad_token_id_for(model, _Tok(None, 9)) == 9
    assert pad_token_id_for(model, None) == 3  # the model's EOS
    padded = ScalarHeadModel(dataclasses.replace(CONFIG, pad_token_id=5))
    assert pad_token_id_for(padded, _Tok(None, 9)) == 5
