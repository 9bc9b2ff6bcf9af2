"""Value-model (PPO critic) directories against transformers: our export loads as
``AutoModelForTokenClassification`` (the class verl's critic is) and its logits ``[B, S, 1]``
equal our values for the llama (tied embeddings, as ``model=tiny``), qwen2, qwen3 and a
Qwen3-MoE family; it loads back here bit-exact; transformers' own token-classification
export, a reward model's export and a causal LM's load as critics; ``from_policy`` copies
the backbone; ``check_value_source`` refuses what is not a model, naming the path and what
is missing, without reading a tensor."""

from __future__ import annotations

import json
import logging

import pytest
import torch
from safetensors import safe_open

from astrai.model import ModelConfig, Transformer, load_pretrained, save_pretrained
from astrai.model.reward import RewardModel, save_reward_model
from astrai.model.value import (
    ValueModel,
    check_value_source,
    load_value_model,
    save_value_model,
)
from astrai.tokenizer import AutoTokenizer

transformers = pytest.importorskip("transformers")

TEXTS = [
    "What is 2 + 3? 5",
    "Name a fruit. An apple, which is red or green.",
    "Count to five, please, slowly. one two three four five",
] * 20
TINY = dict(num_hidden_layers=2, num_key_value_heads=1, initializer_range=0.2)
FAMILIES = {
    "llama": ("LlamaForTokenClassification", dict(tie_word_embeddings=True)),  # as tiny
    "qwen2": ("Qwen2ForTokenClassification", dict(attention_bias=True)),
    "qwen3": ("Qwen3ForTokenClassification", dict(qk_norm=True, head_dim=8)),
    "qwen3_moe": (
        "Qwen3MoeForTokenClassification",
        dict(qk_norm=True, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24),
    ),
}


@pytest.fixture(scope="module")
def policy_dirs(tmp_path_factory, build_model_dir):
    """A random-weight policy directory (astrai's own format) per family."""
    return {
        family: build_model_dir(
            tmp_path_factory.mktemp(family), TEXTS, vocab_size=300, **TINY, **extra
        )
        for family, (_, extra) in FAMILIES.items()
    }


def _critic(policy_dir) -> ValueModel:
    """A critic from the policy with a head that is not transformers' fresh one (a bias
    that is not 0), so the test sees every tensor."""
    torch.manual_seed(0)
    critic = ValueModel.from_policy(load_pretrained(policy_dir, dtype=torch.float32))
    with torch.no_grad():
        critic.score.bias.fill_(0.37)
        for p in critic.parameters():  # norms are 1 and biases 0 at init: perturb them all
            p.add_(torch.randn_like(p) * 0.02)
    return critic.eval()


def _batch(tok: AutoTokenizer) -> tuple[torch.Tensor, torch.Tensor]:
    """A right-padded batch of three texts and its attention mask."""
    rows = [tok.encode(t) for t in TEXTS[:3]]
    n = max(len(r) for r in rows)
    ids = torch.full((len(rows), n), tok.pad_token_id)
    mask = torch.zeros(len(rows), n, dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, : len(r)] = torch.tensor(r)
        mask[i, : len(r)] = 1
    assert mask.sum(1).min() < n  # the batch is padded
    return ids, mask


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_export_is_transformers_token_classification_with_equal_logits(
    family, policy_dirs, tmp_path
):
    architecture, _ = FAMILIES[family]
    tok = AutoTokenizer.from_pretrained(policy_dirs[family])
    critic = _critic(policy_dirs[family])
    out = save_value_model(critic, tmp_path / "critic", tok)
    assert out == tmp_path / "critic"
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == [architecture]
    assert config["num_labels"] == 1 and config["id2label"] == {"0": "LABEL_0"}
    assert config["classifier_dropout"] == 0.0
    assert config["pad_token_id"] == tok.pad_token_id is not None
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        keys = set(f.keys())
    assert {"score.weight", "score.bias"} <= keys and "lm_head.weight" not in keys
    assert all(k.startswith(("model.", "score.")) for k in keys)
    assert (out / "tokenizer.json").is_file()
    assert check_value_source(out) == "token_classification"

    hf = transformers.AutoModelForTokenClassification.from_pretrained(out).eval()
    assert type(hf).__name__ == architecture and hf.config.num_labels == 1
    ids, mask = _batch(tok)
    with torch.no_grad():
        theirs = hf(input_ids=ids, attention_mask=mask).logits
        ours = critic(ids, attention_mask=mask)
        theirs_unpadded = hf(input_ids=ids).logits
        ours_unpadded = critic(ids)
    assert theirs.shape == (*ids.shape, 1) and ours.shape == ids.shape
    assert theirs.std() > 1e-2  # not a degenerate constant head
    real = mask.bool()
    torch.testing.assert_close(ours[real], theirs.squeeze(-1)[real], atol=1e-5, rtol=0)
    torch.testing.assert_close(ours_unpadded, theirs_unpadded.squeeze(-1), atol=1e-5, rtol=0)


def test_round_trip_is_bit_exact_and_transformers_export_loads(policy_dirs, tmp_path):
    critic = _critic(policy_dirs["qwen2"])
    save_value_model(critic, tmp_path / "critic")
    back = load_value_model(tmp_path / "critic")
    assert isinstance(back, ValueModel) and not back.training
    mine = critic.state_dict()
    assert set(back.state_dict()) == set(mine)
    for key, value in back.state_dict().items():
        assert value.dtype == mine[key].dtype and torch.equal(value, mine[key]), key
    ids = torch.randint(0, 300, (2, 9), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        assert torch.equal(back(ids), critic(ids))
    # bf16 on the way in; sharded on the way out: the same tensors
    half = load_value_model(tmp_path / "critic", dtype=torch.bfloat16)
    assert half.score.bias.dtype == torch.bfloat16
    sharded = save_value_model(critic, tmp_path / "sharded", max_shard_size=20_000)
    assert (sharded / "model.safetensors.index.json").is_file()
    again = load_value_model(sharded)
    assert all(torch.equal(v, mine[k]) for k, v in again.state_dict().items())
    # a directory transformers wrote (verl saves its critic so) loads here with its values
    hf = transformers.AutoModelForTokenClassification.from_pretrained(tmp_path / "critic")
    with torch.no_grad():
        hf.score.weight.mul_(-2.0)
        hf.score.bias.fill_(-1.5)
    hf.save_pretrained(tmp_path / "hf")
    assert check_value_source(tmp_path / "hf") == "token_classification"
    with torch.no_grad():
        theirs = hf.eval()(input_ids=ids).logits.squeeze(-1)
        ours = load_value_model(tmp_path / "hf")(ids)
    torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=0)


def test_from_policy_copies_the_backbone_and_starts_a_fresh_head(policy_dirs):
    policy = load_pretrained(policy_dirs["llama"], dtype=torch.float32).train()
    before = {k: v.clone() for k, v in policy.state_dict().items()}
    critic = ValueModel.from_policy(policy)
    assert torch.equal(critic.score.bias, torch.zeros(1))
    assert "lm_head.weight" not in critic.state_dict()
    # its own copy: equal values, no storage shared with the policy
    policy_ptrs = {p.data_ptr() for p in policy.parameters()}
    assert not policy_ptrs & {p.data_ptr() for p in critic.parameters()}
    for key, value in critic.state_dict().items():
        if not key.startswith("score."):
            assert torch.equal(value, before[key]), key
    # the values are the head on the policy's final hidden states
    ids = torch.randint(0, 300, (2, 7), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        hidden = policy(ids, return_hidden=True)
        torch.testing.assert_close(critic(ids), critic.score(hidden).squeeze(-1))
    # training the critic leaves the policy alone
    critic(ids).sum().backward()
    assert all(p.grad is None for p in policy.parameters())
    with torch.no_grad():
        for p in critic.parameters():
            p.add_(1.0)
    assert all(torch.equal(v, before[k]) for k, v in policy.state_dict().items())
    with pytest.raises(TypeError, match="does not generate"):
        critic.forward_packed(None, None, None)


def test_a_reward_model_export_starts_a_critic_with_its_head(policy_dirs, tmp_path):
    torch.manual_seed(1)
    reward = RewardModel.from_backbone(load_pretrained(policy_dirs["llama"], dtype=torch.float32))
    save_reward_model(reward, tmp_path / "rm")
    assert check_value_source(tmp_path / "rm") == "sequence_classification"
    critic = load_value_model(tmp_path / "rm")
    assert torch.equal(critic.score.weight, reward.score.weight)
    assert torch.equal(critic.score.bias, torch.zeros(1))
    ids = torch.randint(0, 300, (2, 7), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():  # every position: the reward model's score there
        assert torch.equal(critic(ids), reward.eval()(ids))


def test_a_causal_lm_export_starts_a_critic_with_a_fresh_head(policy_dirs, tmp_path, caplog):
    path = policy_dirs["qwen3"]
    policy = load_pretrained(path, dtype=torch.float32)
    save_pretrained(policy, tmp_path / "hf", hf_format=True)
    for source in (path, tmp_path / "hf"):  # astrai's format and transformers' *ForCausalLM
        assert check_value_source(source) == "causal_lm"
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="astrai.model.value"):
            critic = load_value_model(source)
        lines = [r.getMessage() for r in caplog.records if "fresh" in r.getMessage()]
        assert len(lines) == 1 and str(source) in lines[0]
        assert torch.equal(critic.score.bias, torch.zeros(1))
        assert 0.5 < critic.score.weight.std() / policy.config.initializer_range < 1.5
        mine = policy.state_dict()
        for key, value in critic.state_dict().items():
            if not key.startswith("score."):
                assert torch.equal(value, mine[key]), key


def test_a_fresh_head_is_transformers_init():
    """weight normal(0, initializer_range), bias 0 (as transformers' ``_init_weights``),
    not ``nn.Linear``'s own uniform init: on a head wide enough to tell them apart."""
    config = ModelConfig(
        vocab_size=16,
        hidden_size=512,
        intermediate_size=8,
        num_hidden_layers=1,
        num_attention_heads=1,
        initializer_range=0.05,
    )
    torch.manual_seed(0)
    critic = ValueModel.from_policy(Transformer(config))
    weight = critic.score.weight.detach()
    assert torch.equal(critic.score.bias, torch.zeros(1))
    assert abs(weight.std().item() / 0.05 - 1) < 0.15  # nn.Linear's: 0.0255 / 0.05 - 1
    assert abs(weight.mean().item()) < 3 * 0.05 / 512**0.5
    critic.reset_score(torch.Generator().manual_seed(7))
    expected = torch.empty(1, 512).normal_(0.0, 0.05, generator=torch.Generator().manual_seed(7))
    assert torch.equal(critic.score.weight, expected)


def _write_config(path, **data) -> None:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(data))


def test_check_value_source_refuses_what_is_not_a_model(policy_dirs, tmp_path):
    critic = _critic(policy_dirs["llama"])
    good = save_value_model(critic, tmp_path / "good")
    hf_config = json.loads((good / "config.json").read_text())

    def refused(path, *what: str) -> None:
        with pytest.raises(ValueError) as info:
            check_value_source(path)
        message = str(info.value)
        assert str(path) in message, message
        for w in what:
            assert w in message, message
        with pytest.raises(ValueError):  # the loader refuses it the same way
            load_value_model(path)

    refused(tmp_path / "nope", "not found")
    (tmp_path / "file").write_text("x")
    refused(tmp_path / "file", "not found")
    (tmp_path / "empty").mkdir()
    refused(tmp_path / "empty", "config.json")
    (tmp_path / "garbled").mkdir()
    (tmp_path / "garbled" / "config.json").write_text("{not json")
    refused(tmp_path / "garbled", "config.json", "JSON")
    _write_config(tmp_path / "no_weights", **hf_config)
    refused(tmp_path / "no_weights", "no weights", "model.safetensors")
    _write_config(tmp_path / "bert", **{**hf_config, "architectures": ["BertForMaskedLM"]})
    refused(tmp_path / "bert", "unknown architecture", "BertForMaskedLM")
    _write_config(tmp_path / "family", **{**hf_config, "model_type": "gpt2"})
    refused(tmp_path / "family", "gpt2")
    two = {**hf_config, "id2label": {"0": "A", "1": "B"}, "label2id": {"A": 0, "B": 1}}
    two.pop("num_labels")
    _write_config(tmp_path / "two_labels", **two)
    refused(tmp_path / "two_labels", "2 labels")
    # a token-classification config over a causal LM's weights: no head where one is promised
    headless = tmp_path / "headless"
    save_pretrained(load_pretrained(policy_dirs["llama"]), headless, hf_format=True)
    _write_config(headless, **hf_config)
    refused(headless, "score.weight")


def test_check_value_source_reads_no_tensor(policy_dirs, tmp_path):
    """A sharded export whose shard files are gone: the kind comes from config.json and the
    index alone; only loading the weights finds the shards missing."""
    path = save_value_model(_critic(policy_dirs["llama"]), tmp_path / "c", max_shard_size=20_000)
    for shard in path.glob("model-*.safetensors"):
        shard.unlink()
    assert check_value_source(path) == "token_classification"
    with pytest.raises(ValueError, match="missing"):
        load_value_model(path)
