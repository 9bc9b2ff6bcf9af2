"""A reward model trained by ``strategy=reward`` (a few Lightning steps, exported by the export
callback) used as a GRPO reward by path: ``parse_rewards`` / ``score`` give the scores
transformers' ``AutoModelForSequenceClassification`` computes on the same rendering, which
is the rendering training scored; a bad ``model_path`` fails when the entry is parsed."""

from __future__ import annotations

import copy
import functools
import json
import pickle

import pytest
import torch

from astrai.model import Transformer, preset, preset_model, save_pretrained
from astrai.model.reward import render_for_reward
from astrai.train.learned_reward import LearnedReward
from astrai.train.optim import adamw, constant
from astrai.train.preference import reward_inputs
from astrai.train.strategies.grpo.reward_pool import score
from astrai.train.strategies.grpo.rewards import parse_rewards
from astrai.train.strategies.reward import RewardModule

RECORDS = [
    {"prompt": "What is 12 + 7?", "chosen": "12 + 7 = 19. 19", "rejected": "12 + 7 = 18. 18"},
    {
        "prompt": [
            {"role": "system", "content": "Answer with the number."},
            {"role": "user", "content": "What is 30 - 4?"},
        ],
        "chosen": "30 - 4 = 26. 26",
        "rejected": "30 - 4 = 24. 24",
    },
    {"prompt": "What is 5 + 5?", "chosen": "5 + 5 = 10. 10", "rejected": "5 + 5 = 11. 11"},
    {"prompt": "What is 9 - 3?", "chosen": "9 - 3 = 6. 6", "rejected": "9 - 3 = 7. 7"},
] * 2
TARGET = "astrai.train.learned_reward.LearnedReward"


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A tokenizer, preference data prepared from RECORDS, and a reward model trained on it
    for a few steps and exported by `ExportCallback`: (root, export dir, head before)."""
    import lightning as L

    from astrai.data import AstraiDataModule, PreferenceDataset
    from astrai.data.prepare import prepare
    from astrai.tokenizer import AutoTokenizer
    from astrai.train.callbacks import ExportCallback

    root = tmp_path_factory.mktemp("learned")
    texts = [json.dumps(r) for r in RECORDS] * 10
    AutoTokenizer.train(texts, vocab_size=300).save_pretrained(root / "tok")
    (root / "pairs.jsonl").write_text("\n".join(json.dumps(r) for r in RECORDS))
    prepare("preference", root / "pairs.jsonl", root, root / "tok", name="pairs", progress=False)
    vocab = len(AutoTokenizer.from_pretrained(root / "tok"))
    torch.manual_seed(0)
    module = RewardModule(
        model=functools.partial(preset_model, "tiny", vocab_size=vocab),
        optimizer=functools.partial(adamw, lr=1e-2),
        scheduler=constant,
        tokenizer=str(root / "tok"),
        center_rewards_coefficient=0.01,
    )
    head = module.model.score.weight.detach().clone()
    data = AstraiDataModule(train=PreferenceDataset(str(root / "pairs.h5")), batch_size=4, seed=0)
    trainer = L.Trainer(
        default_root_dir=root,
        max_steps=3,
        accelerator="cpu",
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        callbacks=[ExportCallback(dirpath=root / "export")],
    )
    trainer.fit(module, datamodule=data)
    return root, root / "export", head


def _hf_scores(path, sequences):
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoModelForSequenceClassification.from_pretrained(path).eval()
    out = []
    with torch.no_grad():
        for s in sequences:  # one at a time: no padding at all on this side
            out.append(hf(input_ids=torch.tensor([s])).logits[0, 0].item())
    return torch.tensor(out)


def test_the_export_is_trained_and_has_the_head(trained):
    _, export, head = trained
    config = json.loads((export / "config.json").read_text())
    assert config["architectures"] == ["LlamaForSequenceClassification"]
    assert (export / "training_state.json").is_file() and (export / "tokenizer.json").is_file()
    reward = LearnedReward(str(export), device="cpu")
    assert not torch.equal(reward._load().score.weight.detach(), head)  # the head trained


def test_training_scored_the_rendering_the_reward_scores(trained):
    from astrai.data import PreferenceDataset
    from astrai.tokenizer import AutoTokenizer

    root, _, _ = trained
    tok = AutoTokenizer.from_pretrained(root / "tok")
    ds = PreferenceDataset(str(root / "pairs.h5"))
    batch = ds.collate([ds[i] for i in range(len(RECORDS))])
    ids, last = reward_inputs(batch)
    n = len(RECORDS)
    for i, record in enumerate(RECORDS):
        for row, side in ((i, "chosen"), (n + i, "rejected")):
            expected = render_for_reward(tok, record["prompt"], record[side])
            assert ids[row, : last[row] + 1].tolist() == expected, (i, side)


def test_learned_reward_by_path_scores_like_transformers(trained):
    _, export, _ = trained
    entry = {"_target_": TARGET, "model_path": str(export), "weight": 2.0, "max_batch_tokens": 40}
    rewards = parse_rewards([entry, {"name": "exact_match", "weight": 0.0}])
    assert rewards[0] == ("LearnedReward", 2.0)
    records = [{"prompt": r["prompt"], "answer": "19"} for r in RECORDS[:4]]
    completions = [r["chosen"] for r in RECORDS[:3]] + ["no idea"]
    total, parts = score(records, completions, rewards)
    fn = rewards[0].fn
    theirs = _hf_scores(export, [fn.render(r, c) for r, c in zip(records, completions)])
    assert theirs.std() > 1e-4  # distinct scores, not a constant
    torch.testing.assert_close(total, 2.0 * theirs, atol=1e-5, rtol=0)
    assert parts["LearnedReward"].item() == pytest.approx(theirs.mean().item(), abs=1e-5)
    assert fn(records[0], completions[0]) == pytest.approx(theirs[0].item(), abs=1e-5)


def test_copies_and_pickles_carry_the_path_and_reload(trained):
    _, export, _ = trained
    reward = LearnedReward(str(export), device="cpu")
    record, text = {"prompt": "What is 5 + 5?"}, "10"
    expected = reward(record, text)
    blob = pickle.dumps(reward)
    assert len(blob) < 2_000  # options only, no weights
    for other in (pickle.loads(blob), copy.deepcopy(reward)):
        assert other._model is None
        assert other(record, text) == pytest.approx(expected, abs=1e-6)


def test_a_bad_model_path_is_named_when_parsed(trained, tmp_path):
    root, _, _ = trained
    with pytest.raises(ValueError, match=r"strategy\.rewards\[0\].*model_path=.*not found"):
        parse_rewards([{"_target_": TARGET, "model_path": str(tmp_path / "nope")}])
    causal = tmp_path / "causal"
    from astrai.tokenizer import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(root / "tok")
    save_pretrained(Transformer(preset("tiny", vocab_size=len(tok))), causal, tokenizer=tok)
    with pytest.raises(ValueError, match=r"model_path=.*score\.weight"):
        parse_rewards([{"_target_": TARGET, "model_path": str(causal)}])
    with pytest.raises(ValueError, match="max_batch_tokens"):
        LearnedReward(str(causal), max_batch_tokens=0)
