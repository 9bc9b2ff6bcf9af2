"""Learning signal: each strategy, through its public module, the data pipeline and Lightning,
moves a trivially learnable toy the way it claims (seconds each, deterministic).

Each test measures the outcome independently of the strategy's own loss and metrics (greedy
decoding, plain log-softmax of a plain forward), and is built so that the bug its docstring
names makes it fail (each was checked by breaking the code on purpose).
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import pytest
import torch
from train_helpers import quiet_trainer

from astrai.data.rewards import register_reward
from astrai.model import preset_model
from astrai.train.optim import adamw, constant

EOS = 1


def _jsonl(path: Path, records: list[dict]) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


def _fit(module, datamodule, steps: int, root: Path) -> None:
    trainer = quiet_trainer(
        default_root_dir=root, max_steps=steps, limit_val_batches=0, use_distributed_sampler=False
    )
    trainer.fit(module, datamodule=datamodule)


# ---------------------------------------------------------------------------- SFT

# Three prompts continue [10, 11] with a third token; a fourth prompt is just [10]. A loss
# that also covered prompt tokens would teach "10 -> 11" three times against "10 -> 30"
# once, and the fourth answer would be lost.
SFT_PAIRS = [
    ([10, 11, 12], [20, 21, EOS]),
    ([10, 11, 13], [22, 23, EOS]),
    ([10, 11, 14], [24, 25, EOS]),
    ([10], [30, 31, EOS]),
]


def _greedy(model, prompt: list[int], n: int) -> list[int]:
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(model(torch.tensor([ids]))[0, -1].argmax()))
    return ids[len(prompt) :]


def test_sft_memorises_answers_to_greedy_exact_match(tmp_path):
    """SFT on four prompt/answer documents (loss mask on the answers) reaches greedy exact
    match 1.0 on all of them, from 0.

    Catches: the loss sign flipped (likelihood pushed down); the loss mask off by one (the
    first answer token, predicted from the last prompt token, is never learnt); the mask on
    the prompt too (prompt [10] then continues with 11, learnt three times, not 30).
    """
    from astrai.data import AstraiDataModule, SFTDataset
    from astrai.train.strategies.sft import SFTModule

    records = [{"input_ids": p + a, "loss_mask": [0] * len(p) + [1] * len(a)} for p, a in SFT_PAIRS]
    data = SFTDataset(_jsonl(tmp_path / "sft.jsonl", records))
    torch.manual_seed(0)
    module = SFTModule(
        model=functools.partial(preset_model, "tiny"),
        optimizer=functools.partial(adamw, lr=1e-2, weight_decay=0.0),
        scheduler=constant,
    )

    def exact_match() -> float:
        module.model.eval()
        hits = [_greedy(module.model, p, len(a)) == a for p, a in SFT_PAIRS]
        return sum(hits) / len(hits)

    assert exact_match() == 0.0
    _fit(module, AstraiDataModule(train=data, batch_size=4, seed=0), 40, tmp_path)
    assert exact_match() == 1.0


# ---------------------------------------------------------------------------- DPO

# One-token answers: the response mask covers exactly the token that differs, so a mask off
# by one in either direction covers nothing of the answer.
DPO_PAIRS = [
    ([10, 11], 40, 41),
    ([12, 13], 42, 43),
    ([14], 44, 45),
    ([15, 16, 17], 46, 47),
]


def _margins(policy, reference) -> torch.Tensor:
    """(log pi(c) - log ref(c)) - (log pi(r) - log ref(r)) per pair, from plain forwards."""
    out = []
    with torch.no_grad():
        for prompt, chosen, rejected in DPO_PAIRS:
            x = torch.tensor([prompt])
            lp = torch.log_softmax(policy(x)[0, -1].double(), -1)
            lr = torch.log_softmax(reference(x)[0, -1].double(), -1)
            out.append((lp[chosen] - lr[chosen]) - (lp[rejected] - lr[rejected]))
    return torch.stack(out)


def test_dpo_raises_margin_and_preference_accuracy(tmp_path):
    """DPO on four preference pairs raises the chosen-minus-rejected log-ratio margin on
    every pair (preference accuracy 0 -> 1; policy == reference at the start).

    Catches: the loss sign flipped or chosen/rejected swapped (margins go negative); the
    response mask off by one, either way (the answer token is outside the loss: nothing
    moves). A mask that also covers the prompt is harmless here: the prompt's log-probs are
    the same in chosen and rejected and cancel.
    """
    from astrai.data import AstraiDataModule, PreferenceDataset
    from astrai.train.strategies.dpo import DPOModule

    records = []
    for prompt, chosen, rejected in DPO_PAIRS:
        mask = [0] * len(prompt) + [1]
        records.append(
            {
                "chosen_ids": [*prompt, chosen],
                "chosen_mask": mask,
                "rejected_ids": [*prompt, rejected],
                "rejected_mask": mask,
            }
        )
    data = PreferenceDataset(_jsonl(tmp_path / "pref.jsonl", records))
    torch.manual_seed(0)
    module = DPOModule(
        model=functools.partial(preset_model, "tiny"),
        optimizer=functools.partial(adamw, lr=3e-3, weight_decay=0.0),
        scheduler=constant,
        beta=0.1,
    )
    reference = module.reference.model
    before = _margins(module.model, reference)
    assert before.abs().max() < 1e-9  # accuracy 0: no pair strictly preferred
    _fit(module, AstraiDataModule(train=data, batch_size=4, seed=0), 15, tmp_path)
    after = _margins(module.model.eval(), reference)
    assert (after > 1.0).all(), after  # accuracy 1, each margin clearly positive (~6)


# ---------------------------------------------------------------------------- GRPO

TARGET_REWARD = "test_learning_signal_first_token"


@register_reward(TARGET_REWARD)
def _starts_with_target(record, completion: str) -> float:
    """1 if the completion starts with the record's target text (its first token's)."""
    return float(completion.startswith(record["target"]))


@pytest.fixture(scope="module")
def grpo_tokenizer(tmp_path_factory) -> Path:
    from astrai.data.builtin import arithmetic_problems, sft_records
    from astrai.tokenizer import AutoTokenizer

    root = tmp_path_factory.mktemp("signal")
    texts = [m["content"] for r in sft_records(arithmetic_problems(300)) for m in r["messages"]]
    AutoTokenizer.train(texts * 2, vocab_size=320).save_pretrained(root / "tok")
    return root / "tok"


def _expected_reward(model, tok, prompts, targets, temperature) -> float:
    """Exact mean reward of the first sampled token: the probability mass (at the sampling
    temperature) of the tokens whose text starts with the target."""
    total = 0.0
    with torch.no_grad():
        for prompt, target in zip(prompts, targets):
            probs = torch.softmax(model(torch.tensor([prompt]))[0, -1].double() / temperature, -1)
            hits = [i for i in range(len(probs)) if tok.decode([i]).startswith(target)]
            total += float(probs[hits].sum())
    return total / len(prompts)


def test_grpo_raises_the_reward_of_one_token(tmp_path, grpo_tokenizer):
    """GRPO with a reward of 1 when a completion starts with a given token (a different one
    per prompt, of moderate initial probability) raises the expected reward a lot.

    Rollouts come from the real engine on the live weights; the reward only looks at the
    first completion token. Catches: the loss or advantage sign flipped (the reward falls to
    ~0); advantages not matched to their completions (rolled within the group: ~0); the
    completion mask with its rollout log-probs off by one, either way (the first completion
    token falls out of the loss, or its ratio is taken against its neighbour's log-prob and
    clipped: 0.24 at best). Not caught, as they still learn: advantages without the group mean
    (REINFORCE without a baseline); training log-probs at another temperature than the
    rollout's (test_grpo.py checks the ratio for that).
    """
    from astrai.data.datasets import collate_prompt
    from astrai.tokenizer import AutoTokenizer
    from astrai.train.strategies.grpo import GRPOModule

    tok = AutoTokenizer.from_pretrained(str(grpo_tokenizer))
    torch.manual_seed(0)
    module = GRPOModule(
        model=functools.partial(preset_model, "tiny", vocab_size=320, initializer_range=0.3),
        optimizer=functools.partial(adamw, lr=3e-3, weight_decay=0.0),
        scheduler=constant,
        tokenizer=str(grpo_tokenizer),
        num_generations=8,
        max_new_tokens=2,
        temperature=0.8,
        rewards=[TARGET_REWARD],
        kl_coef=0.0,
    )
    prompts = [tok.encode(s) for s in ("What is 2 + 3?", "Say", "7 * 8 =", "Hello")]
    targets = []
    with torch.no_grad():  # per prompt: the printable token closest to 15% initial probability
        for prompt in prompts:
            probs = torch.softmax(module.model(torch.tensor([prompt]))[0, -1] / 0.8, -1)
            printable = [
                i
                for i in range(len(probs))
                if tok.decode([i]).strip().isascii()
                and tok.decode([i]).strip().isprintable()
                and tok.decode([i]).strip()
            ]
            best = min(printable, key=lambda i: abs(float(probs[i]) - 0.15))
            targets.append(tok.decode([best]))
    before = _expected_reward(module.model, tok, prompts, targets, 0.8)
    assert 0.05 < before < 0.4, (before, targets)

    items = [
        {"prompt_ids": torch.tensor(p), "record": {"target": t}} for p, t in zip(prompts, targets)
    ]
    loader = torch.utils.data.DataLoader(items, batch_size=4, collate_fn=collate_prompt)
    trainer = quiet_trainer(default_root_dir=tmp_path, max_steps=20, limit_val_batches=0)
    trainer.fit(module, train_dataloaders=loader)
    after = _expected_reward(module.model.eval(), tok, prompts, targets, 0.8)
    assert after > before + 0.4, (before, after)  # measured: 0.08 -> 0.75
