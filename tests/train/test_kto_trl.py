"""Our KTO against TRL 1.16's own: a real ``KTOTrainer`` on a tiny random local Llama runs
one batch of its own tokenisation and collator through its ``compute_loss``; our
``KTOModule`` loads the same export and runs the batch ``collate_unpaired`` builds from
TRL's token ids (same prompt/completion split). Reference = the initial weights on both
sides, the policy perturbed identically. Loss, rewards, KL, log-probs and the gradient of
every parameter must agree to 1e-6, for both loss types and unequal weights. The models run
in float64; both sides take the log-softmax in float32 (TRL's fused LM-head kernel and our
``token_logprobs``), so a gradient agrees to 1e-6 of its tensor's largest entry, not
element by element."""

from __future__ import annotations

import functools
import logging

import pytest
import torch

trl = pytest.importorskip("trl")

from train_helpers import memory_logger, quiet_trainer  # noqa: E402
from trl_helpers import hf_parts  # noqa: E402

from astrai.data import AstraiDataModule, collate_unpaired  # noqa: E402
from astrai.model import load_pretrained  # noqa: E402
from astrai.model.hub import to_hf_key  # noqa: E402
from astrai.train.optim import adamw  # noqa: E402
from astrai.train.strategies.kto import KTOModule, weight_advice  # noqa: E402

BETA, DESIRABLE_WEIGHT, UNDESIRABLE_WEIGHT = 0.1, 1.0, 2.0
# the word-level tokenizer splits its special tokens t0/t1 out of longer words: no t1x here
PROMPTS = ["t2 t3", "t4 t5 t6", "t7", "t8 t9", "t20 t21"]
COMPLETIONS = [" t22 t23 ", " t24 ", " t25 t26 t27 ", " t28 t29 ", " t30 t31 t2 "]
LABELS = [True, False, True, False, True]


@pytest.fixture(scope="module")
def parts(tmp_path_factory):
    return hf_parts(tmp_path_factory.mktemp("kto"))


def _trainer(parts, loss_type: str):
    from datasets import Dataset

    root, tok = parts
    args = trl.KTOConfig(
        output_dir=str(root / f"out-{loss_type}"),
        report_to="none",
        use_cpu=True,
        bf16=False,
        gradient_checkpointing=False,
        model_init_kwargs={"dtype": torch.float64},
        per_device_train_batch_size=len(PROMPTS),
        beta=BETA,
        desirable_weight=DESIRABLE_WEIGHT,
        undesirable_weight=UNDESIRABLE_WEIGHT,
        loss_type=loss_type,
    )
    data = Dataset.from_dict({"prompt": PROMPTS, "completion": COMPLETIONS, "label": LABELS})
    trainer = trl.KTOTrainer(
        model=str(root / "model"), args=args, train_dataset=data, processing_class=tok
    )
    trainer.model.train()
    return trainer


def _perturbation(trainer, batch, noise: float = 0.1, step: float = 3.0) -> dict[str, torch.Tensor]:
    """A fixed change per HF parameter name, so the loss is not at its trivial point (policy =
    reference: zero rewards and KL): noise, plus a step up the likelihood of the completions
    so the KL estimate on their mismatched pairs is positive (noise alone, here, makes it
    negative: clamped to 0)."""
    model = trainer.model
    labels = batch["input_ids"].masked_fill(batch["completion_mask"] == 0, -100)
    model(
        input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], labels=labels
    ).loss.backward()
    g = torch.Generator().manual_seed(1)
    delta = {}
    for name, p in sorted(model.named_parameters()):
        delta[name] = noise * torch.randn(p.shape, generator=g, dtype=torch.float64)
        delta[name] -= step * p.grad
        p.grad = None
    return delta


def _apply(named: dict[str, torch.nn.Parameter], delta: dict[str, torch.Tensor]) -> None:
    with torch.no_grad():
        for name, p in named.items():
            p.add_(delta[name])


def _ours(parts, loss_type: str) -> KTOModule:
    root, _ = parts
    module = KTOModule(
        model=load_pretrained(root / "model", dtype=torch.float64),
        beta=BETA,
        desirable_weight=DESIRABLE_WEIGHT,
        undesirable_weight=UNDESIRABLE_WEIGHT,
        loss_type=loss_type,
    )
    module.train()
    return module


def _astrai_batch(trainer) -> dict[str, torch.Tensor]:
    """Our batch from TRL's token ids: its prompt / completion split, every completion token
    scored (TRL's completion mask)."""
    rows = trainer.train_dataset
    items = [
        {
            "prompt_ids": torch.tensor(r["prompt_ids"]),
            "completion_ids": torch.tensor(r["completion_ids"]),
            "completion_mask": torch.ones(len(r["completion_ids"]), dtype=torch.bool),
            "label": torch.tensor(r["label"]),
        }
        for r in rows
    ]
    return collate_unpaired(items, pad_id=0)


def _same_rows(ours_ids, ours_attention, theirs_ids, theirs_attention) -> None:
    """Our shifted rows are TRL's unshifted rows without their last real token."""
    for i in range(theirs_ids.shape[0]):
        full = theirs_ids[i][theirs_attention[i].bool()].tolist()
        n = int(ours_attention[i].sum())
        assert ours_ids[i, :n].tolist() == full[:-1], i


@pytest.mark.parametrize(
    ("loss_type", "noise", "step"),
    [("kto", 0.1, 3.0), ("kto", 0.3, 0.0), ("apo_zero_unpaired", 0.1, 3.0)],
    ids=["kto", "kto-kl-clamped", "apo_zero_unpaired"],
)
def test_kto_equals_trl(parts, loss_type, noise, step):
    trainer = _trainer(parts, loss_type)
    theirs_batch = next(iter(trainer.get_train_dataloader()))
    ours_batch = _astrai_batch(trainer)
    assert ours_batch["label"].tolist() == LABELS == theirs_batch["label"].tolist()
    _same_rows(
        ours_batch["input_ids"],
        ours_batch["attention_mask"],
        theirs_batch["input_ids"],
        theirs_batch["attention_mask"],
    )
    if loss_type == "kto":  # the same mismatched partner: the previous row's completion
        _same_rows(
            ours_batch["kl_input_ids"],
            ours_batch["kl_attention_mask"],
            theirs_batch["KL_input_ids"],
            theirs_batch["KL_attention_mask"],
        )

    module = _ours(parts, loss_type)
    hf_params = dict(trainer.model.named_parameters())
    our_params = {to_hf_key(n): p for n, p in module.model.named_parameters()}
    assert set(our_params) == set(hf_params)
    for name, p in our_params.items():
        assert torch.equal(p, hf_params[name]), name
    delta = _perturbation(trainer, theirs_batch, noise, step)
    _apply(hf_params, delta)
    _apply(our_params, delta)

    theirs = trainer.compute_loss(trainer.model, theirs_batch)
    theirs.backward()
    logged = {k: v[-1] for k, v in trainer._metrics["train"].items()}
    ours, metrics = module.compute_loss(ours_batch)
    ours.backward()

    torch.testing.assert_close(ours, theirs.detach(), rtol=1e-6, atol=1e-6)
    keys = ("rewards/chosen", "rewards/rejected", "rewards/margins", "logps/chosen")
    for key in (*keys, "logps/rejected", "kl"):
        assert metrics[key].item() == pytest.approx(logged[key], rel=1e-6, abs=1e-6), key
    if loss_type == "kto":  # the estimate seen, and the estimate clamped (raw: negative)
        assert (metrics["kl"] > 0) if step else (metrics["kl"] == 0)
    assert metrics["rewards/chosen"] != 0 and metrics["rewards/rejected"] != 0
    assert (metrics["count/chosen"], metrics["count/rejected"]) == (3, 2)
    for name, p in our_params.items():  # to 1e-6 of the tensor's largest entry
        theirs_grad = hf_params[name].grad
        scale = 1e-6 * float(theirs_grad.abs().max())
        torch.testing.assert_close(p.grad, theirs_grad, rtol=1e-6, atol=scale, msg=name)
    assert any(p.grad.abs().sum() > 0 for p in our_params.values())


def test_the_weights_matter(parts):
    """With unequal weights the loss is not the unweighted one (so the test above can tell)."""
    module = _ours(parts, "kto")
    trainer = _trainer(parts, "kto")
    batch = _astrai_batch(trainer)
    delta = _perturbation(trainer, next(iter(trainer.get_train_dataloader())))
    _apply({to_hf_key(n): p for n, p in module.model.named_parameters()}, delta)
    with torch.no_grad():
        weighted, _ = module.compute_loss(batch)
        module.undesirable_weight = module.desirable_weight
        plain, _ = module.compute_loss(batch)
    assert abs(weighted.item() - plain.item()) > 1e-3


def test_weight_advice_matches_trls_warning(parts, caplog):
    """TRL warns at construction about 3 desirable : 2 undesirable with these weights; our
    advice names the same ranges."""
    with caplog.at_level(logging.WARNING):
        _trainer(parts, "kto")
    trl_warning = [
        r.getMessage() for r in caplog.records if "desirable_weight in" in r.getMessage()
    ]
    assert trl_warning
    advice = weight_advice(3, 2, DESIRABLE_WEIGHT, UNDESIRABLE_WEIGHT)
    assert advice is not None
    for span in ("desirable_weight in [", "undesirable_weight in ["):
        theirs = trl_warning[0].split(span)[1].split("]")[0]
        assert advice.split(span)[1].split("]")[0] == theirs
    assert weight_advice(3, 2, 1.0, 1.4) is None  # 1.4 lies in TRL's [1.13, 1.5]
    assert weight_advice(4, 4, 1.0, 9.0) is None  # balanced data: no advice


@pytest.mark.parametrize(
    ("option", "value"),
    [
        ("beta", 0.0),
        ("desirable_weight", -1),
        ("undesirable_weight", 0),
        ("loss_type", "sigmoid"),
        ("reference_dtype", "float17"),
    ],
)
def test_bad_options_are_named_before_the_model_is_built(option, value):
    def never(**_):
        raise AssertionError("the model was built")

    with pytest.raises(ValueError, match=rf"^KTO {option} must"):
        KTOModule(model=never, **{option: value})


class _Rows(torch.utils.data.Dataset):
    """Unpaired items in memory, shaped like ``UnpairedDataset``'s (collate, label counts)."""

    def __init__(self, labels: list[bool]) -> None:
        g = torch.Generator().manual_seed(len(labels))
        self.items = [
            {
                "prompt_ids": torch.randint(2, 32, (3,), generator=g),
                "completion_ids": torch.randint(2, 32, (2 + i % 3,), generator=g),
                "completion_mask": torch.ones(2 + i % 3, dtype=torch.bool),
                "label": torch.tensor(label),
            }
            for i, label in enumerate(labels)
        ]
        self.collate = collate_unpaired

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return self.items[index]

    def label_counts(self) -> tuple[int, int]:
        desirable = sum(bool(i["label"]) for i in self.items)
        return desirable, len(self.items) - desirable


def _fit(parts, batch_size: int, caplog=None, **options):
    root, _ = parts
    module = KTOModule(
        model=load_pretrained(root / "model", dtype=torch.float32),
        optimizer=functools.partial(adamw, lr=1e-2),
        **options,
    )
    logger = memory_logger()
    trainer = quiet_trainer(max_steps=4, logger=logger, log_every_n_steps=1, limit_val_batches=1)
    dm = AstraiDataModule(
        train=_Rows([True, True, True, False] * 4),
        val=_Rows([True, False] * 4),
        batch_size=batch_size,
        drop_last=True,
    )
    trainer.fit(module, datamodule=dm)
    return module, logger.rows


def test_kto_trains_under_lightning_and_warns_about_the_weights(parts, caplog):
    """A few Lightning steps: TRL's metrics are logged for train and val, the reference stays
    the initial policy, and 12 desirable : 4 undesirable with equal weights is warned about
    with the ranges TRL gives."""
    with caplog.at_level(logging.WARNING, logger="astrai.train.strategies.kto"):
        module, rows = _fit(parts, 4)
    assert [weight_advice(12, 4, 1.0, 1.0)] == [
        r.getMessage() for r in caplog.records if r.name == "astrai.train.strategies.kto"
    ]
    logged = {k for row in rows for k in row}
    for key in ("loss", "kl", "rewards/chosen", "logps/chosen", "count/rejected"):
        assert {f"train/{key}", f"val/{key}"} <= logged, key
    initial = load_pretrained(parts[0] / "model", dtype=torch.float32).state_dict()
    reference = module.reference.model.state_dict()
    assert all(torch.equal(initial[k], reference[k]) for k in initial)
    assert any(not torch.equal(initial[k], v) for k, v in module.model.state_dict().items())


def test_kto_needs_two_rows_per_batch_unless_apo_zero(parts):
    with pytest.raises(ValueError, match=r"data\.batch_size must be > 1, got 1"):
        _fit(parts, 1)
    _fit(parts, 1, loss_type="apo_zero_unpaired")  # no KL estimate: a row alone is fine
