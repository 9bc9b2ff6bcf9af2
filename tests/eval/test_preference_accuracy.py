"""``astrai.eval.preference``: held-out preference accuracy of any export, against a plain-torch
count of the same pairs (one sequence per forward, a plain log-softmax)."""

from __future__ import annotations

import pytest
import torch

from astrai.data import PreferenceDataset
from astrai.eval.preference import main, preference_accuracy
from astrai.model import preset_model, save_pretrained
from astrai.train.report import wilson_interval


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """Prepared preference pairs and two different tiny exports (policy, reference)."""
    from astrai.data.builtin import arithmetic_problems, sft_records
    from astrai.data.prepare import prepare
    from astrai.tokenizer import AutoTokenizer

    root = tmp_path_factory.mktemp("prefacc")
    texts = [m["content"] for r in sft_records(arithmetic_problems(200)) for m in r["messages"]]
    tok = AutoTokenizer.train(texts * 2, vocab_size=300)
    tok.save_pretrained(root / "tok")
    prepare(
        "preference",
        "builtin:arithmetic/preference/val",
        root,
        root / "tok",
        name="pairs",
        builtin={"n": 24, "seed": 3},
        progress=False,
    )
    for name, seed in (("policy", 1), ("reference", 2)):
        torch.manual_seed(seed)
        save_pretrained(preset_model("tiny", vocab_size=len(tok)), root / name, tokenizer=tok)
    return root


def _plain_logprobs(path, pairs, side: str, mean: bool) -> list[float]:
    from astrai.model import load_pretrained

    model = load_pretrained(path, dtype=torch.float64)
    out = []
    for i in range(len(pairs)):
        item = pairs[i]
        ids, labels = item[f"{side}_input_ids"], item[f"{side}_labels"]
        with torch.no_grad():
            logp = torch.log_softmax(model(ids[None])[0], -1)
        keep = labels != -100
        total = logp[keep.nonzero()[:, 0], labels[keep]].sum().item()
        out.append(total / int(keep.sum()) if mean else total)
    return out


def _expected(setup, *, reference: bool) -> int:
    pairs = PreferenceDataset(str(setup / "pairs.h5"))
    mean = not reference
    chosen = _plain_logprobs(setup / "policy", pairs, "chosen", mean)
    rejected = _plain_logprobs(setup / "policy", pairs, "rejected", mean)
    if reference:
        ref_c = _plain_logprobs(setup / "reference", pairs, "chosen", mean)
        ref_r = _plain_logprobs(setup / "reference", pairs, "rejected", mean)
        chosen = [a - b for a, b in zip(chosen, ref_c)]
        rejected = [a - b for a, b in zip(rejected, ref_r)]
    return sum(c > r for c, r in zip(chosen, rejected))


@pytest.mark.parametrize("reference", [True, False])
def test_accuracy_counts_the_pairs_a_plain_forward_ranks_right(setup, reference):
    got = preference_accuracy(
        setup / "policy",
        setup / "pairs.h5",
        reference=setup / "reference" if reference else None,
        batch_size=5,
    )
    right = _expected(setup, reference=reference)
    assert (got.n, got.correct) == (24, right)
    assert got.accuracy == pytest.approx(right / 24)
    assert (got.low, got.high) == pytest.approx(wilson_interval(right, 24))


def test_a_reward_model_ranks_by_its_score(setup):
    from astrai.model import load_pretrained
    from astrai.model.reward import RewardModel, render_for_reward, save_reward_model

    torch.manual_seed(4)
    reward = RewardModel.from_backbone(load_pretrained(setup / "policy"))
    reward.reset_score()
    path = setup / "reward"
    from astrai.tokenizer import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(setup / "tok"))
    save_reward_model(reward, path, tokenizer=tok)
    got = preference_accuracy(path, setup / "pairs.h5")
    # independently: each pair's two chats rendered as at training time, scored one at a time
    from astrai.data.builtin import builtin_records

    right = 0
    with torch.no_grad():
        for rec in builtin_records("arithmetic/preference/val", n=24, seed=3):
            scores = []
            for side in ("chosen", "rejected"):
                ids = render_for_reward(tok, rec["prompt"], rec[side])
                scores.append(reward(torch.tensor([ids]))[0, -1].item())
            right += scores[0] > scores[1]
    assert (got.n, got.correct) == (24, right)
    with pytest.raises(ValueError, match="--reference"):
        preference_accuracy(path, setup / "pairs.h5", reference=setup / "reference")


def test_the_command_names_a_missing_path(setup, capsys):
    with pytest.raises(SystemExit):
        main(["--policy", str(setup / "nope"), "--pairs", str(setup / "pairs.h5")])
    assert "--policy" in capsys.readouterr().err
    assert main(["--policy", str(setup / "policy"), "--pairs", str(setup / "pairs.h5")]) == 0
    assert '"n": 24' in capsys.readouterr().out
