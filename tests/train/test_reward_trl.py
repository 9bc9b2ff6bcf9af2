"""Our Bradley-Terry reward loss against TRL 1.16's ``RewardTrainer``: a real trainer on our
export (loaded by ``AutoModelForSequenceClassification``) computes its loss with its own
``compute_loss`` on its own collator's batch; ``RewardModule.compute_loss`` on the same
token ids (as our preference collate shapes them) must give the same loss, metrics and
gradients, in float64. Plus what makes the head train: LoRA, optimizer, checkpoint."""

from __future__ import annotations

import pytest
import torch

trl = pytest.importorskip("trl")

from trl_helpers import hf_parts  # noqa: E402

from astrai.data.datasets import IGNORE_INDEX, collate_preference  # noqa: E402
from astrai.model import load_pretrained  # noqa: E402
from astrai.model.reward import RewardModel, save_reward_model  # noqa: E402
from astrai.train.preference import reward_inputs  # noqa: E402
from astrai.train.strategies.reward import RewardModule  # noqa: E402

# (prompt length, chosen, rejected): token ids in [2, 32) (0 is padding, 1 EOS)
PAIRS = [
    (2, [5, 6, 7, 8, 9], [5, 6, 10, 11]),
    (3, [12, 13, 14, 15, 16, 17, 18], [12, 13, 14, 19]),
    (1, [20, 21, 22], [20, 23, 24, 25, 26, 27]),
    (2, [28, 29, 30, 31], [28, 29, 2]),
]
MARGINS = [0.5, 0.0, -0.25, 1.0]
TRAILING = 3  # pair 3's chosen side gets a trailing unlabelled token, as a template's "\n"


@pytest.fixture(scope="module")
def parts(tmp_path_factory):
    root, tok = hf_parts(tmp_path_factory.mktemp("reward-trl"))
    torch.manual_seed(1)
    model = RewardModel.from_backbone(load_pretrained(root / "model", dtype=torch.float32))
    with torch.no_grad():
        model.score.weight.normal_(0.0, 0.5)  # rewards of order 1: gradients worth comparing
    save_reward_model(model, root / "rm", tokenizer=tok)
    return root, tok


@pytest.fixture(scope="module")
def trainer(parts):
    from datasets import Dataset

    root, tok = parts
    data = Dataset.from_dict(
        {
            "chosen_ids": [c for _, c, _ in PAIRS],
            "rejected_ids": [r for _, _, r in PAIRS],
            "margin": MARGINS,
        }
    )
    args = trl.RewardConfig(
        output_dir=str(root / "out"),
        report_to="none",
        use_cpu=True,
        bf16=False,
        activation_checkpointing=False,
        max_length=None,
    )
    t = trl.RewardTrainer(
        model=str(root / "rm"), args=args, train_dataset=data, processing_class=tok
    )
    t.model.double().train()
    return t


def _item(side: str, ids: list[int], prompt: int, trailing: int | None) -> dict:
    """One side as ``PreferenceDataset`` yields it: input_ids stop one token short, labels
    are the next tokens on the answer only."""
    doc = torch.tensor(ids + ([trailing] if trailing is not None else []))
    mask = torch.arange(len(doc)) >= prompt
    if trailing is not None:
        mask[-1] = False
    return {
        f"{side}_input_ids": doc[:-1],
        f"{side}_labels": doc[1:].masked_fill(~mask[1:], IGNORE_INDEX),
        f"{side}_loss_mask": mask[1:],
        f"{side}_position_ids": torch.arange(len(doc) - 1),
    }


def _our_batch(margin: bool) -> dict:
    items = []
    for i, (p, c, r) in enumerate(PAIRS):
        item = _item("chosen", c, p, 4 if i == TRAILING else None)
        item.update(_item("rejected", r, p, None))
        items.append(item)
    batch = collate_preference(items, pad_id=0)
    if margin:
        batch["margin"] = torch.tensor(MARGINS)
    return batch


def _trl_loss(trainer, margin: bool, coef: float | None):
    rows = [trainer.train_dataset[i] for i in range(len(PAIRS))]
    if not margin:
        rows = [{k: v for k, v in row.items() if k != "margin"} for row in rows]
    batch = trainer.data_collator(rows)
    trainer.args.center_rewards_coefficient = coef
    trainer.model.zero_grad()
    loss = trainer.compute_loss(trainer.model, batch)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in trainer.model.named_parameters()}
    metrics = {k: v[-1] for k, v in trainer._metrics["train"].items()}
    return loss.detach(), grads, metrics


def _ours(parts, margin: bool, coef: float | None):
    root, _ = parts
    module = RewardModule(
        model=load_pretrained(root / "model", dtype=torch.float32),
        init_from=str(root / "rm"),
        center_rewards_coefficient=coef,
    ).double()
    loss, metrics = module.compute_loss(_our_batch(margin))
    loss.backward()
    grads = {n: p.grad for n, p in module.model.named_parameters()}
    return loss.detach(), grads, metrics


def test_reward_inputs_are_the_documents_up_to_the_last_answer_token():
    ids, last = reward_inputs(_our_batch(margin=False))
    docs = [c for _, c, _ in PAIRS] + [r for _, _, r in PAIRS]
    assert last.tolist() == [len(d) - 1 for d in docs]
    for row, doc in zip(ids, docs):
        assert row[: len(doc)].tolist() == doc


@pytest.mark.parametrize("margin, coef", [(False, None), (False, 0.05), (True, None), (True, 0.01)])
def test_loss_and_gradients_equal_trl_reward_trainer(parts, trainer, margin, coef):
    theirs, their_grads, their_metrics = _trl_loss(trainer, margin, coef)
    ours, our_grads, our_metrics = _ours(parts, margin, coef)
    assert theirs.dtype == ours.dtype == torch.float64
    torch.testing.assert_close(ours, theirs, atol=1e-6, rtol=0)
    assert set(our_grads) == {n.removeprefix("model.") for n in their_grads}
    for name, grad in their_grads.items():
        mine = our_grads[name.removeprefix("model.")]
        torch.testing.assert_close(mine, grad, atol=1e-6, rtol=0, msg=name)
    assert their_grads["score.weight"].abs().max() > 1e-3  # the head does learn
    assert our_metrics["accuracy"].item() == pytest.approx(their_metrics["accuracy"])
    assert our_metrics["margin"].item() == pytest.approx(their_metrics["margin"], abs=1e-6)


def test_the_head_trains_with_lora_and_is_checkpointed(parts, tmp_path):
    root, tok = parts
    lora = {"r": 2, "lora_alpha": 4, "target_modules": ["q_proj", "v_proj"]}
    module = RewardModule(model=load_pretrained(root / "model", dtype=torch.float32), lora=lora)
    trainable = {n for n, p in module.model.named_parameters() if p.requires_grad}
    assert "score.weight" in trainable
    assert all(n == "score.weight" or ".lora_" in n for n in trainable)
    opt = module.configure_optimizers()["optimizer"]
    in_opt = {id(p) for g in opt.param_groups for p in g["params"]}
    assert id(module.model.score.weight) in in_opt
    assert "model.score.weight" in module.state_dict()
    assert not any(k.startswith("model.lm_head") for k in module.state_dict())
    assert module.hparams["init_from"] is None and module.hparams["lora"] == lora
    loss, _ = module.compute_loss(_our_batch(margin=False))
    loss.backward()
    assert module.model.score.weight.grad is not None
    # the export merges the adapters and writes the head
    module.tokenizer = tok
    out = module.save_pretrained(tmp_path / "export", hf_format=False)
    from astrai.model.reward import load_reward_model

    back = load_reward_model(out)
    torch.testing.assert_close(back.score.weight, module.model.score.weight.detach())


def test_bad_options_are_named(parts):
    root, _ = parts
    for bad in (-0.1, float("nan"), "x"):
        with pytest.raises(ValueError, match="center_rewards_coefficient"):
            RewardModule(
                model=load_pretrained(root / "model", dtype=torch.float32),
                center_rewards_coefficient=bad,
            )


def test_the_strategy_config_builds_a_reward_module():
    from pathlib import Path

    from hydra import compose, initialize_config_dir

    from astrai.train.runner import instantiate_strategy

    conf = Path(__file__).resolve().parents[2] / "conf"
    overrides = ["strategy=reward", "data=arithmetic_preference"]
    with initialize_config_dir(config_dir=str(conf), version_base="1.3"):
        cfg = compose("train", overrides=[*overrides, "strategy.center_rewards_coefficient=0.01"])
    module = instantiate_strategy(cfg, None)
    assert isinstance(module, RewardModule) and isinstance(module.model, RewardModel)
    assert module.center_rewards_coefficient == 0.01
    assert module.hparams["center_rewards_coefficient"] == 0.01
