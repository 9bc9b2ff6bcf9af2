"""CPO / SimPO / ORPO without TRL: their options are checked before the model is built, the
losses follow their formulas on fixed numbers, the strategy configs build the modules, no
reference model exists in memory or in checkpoints, and a few Lightning steps on prepared
arithmetic preference pairs lower the loss. (Parity with TRL: test_reference_free_trl.py.)"""

from __future__ import annotations

import functools
import glob
import math

import pytest
import torch
from torch import nn
from train_helpers import quiet_trainer

from astrai.model import Transformer, preset_model
from astrai.train.module import ReferencePolicy
from astrai.train.optim import adamw, constant
from astrai.train.strategies.cpo import CPOModule, cpo_loss
from astrai.train.strategies.orpo import (
    ORPOModule,
    full_sequence_labels,
    log1mexp,
    orpo_log_odds,
)


def _sig(x: float) -> float:
    return 1 / (1 + math.exp(-x))


# ------------------------------------------------------------------ options


class _NoModel:
    """A model factory that records whether it was called."""

    called = False

    def __call__(self, **_):
        self.called = True
        raise AssertionError("the model was built before the options were checked")


BAD_OPTIONS = [
    (CPOModule, {"loss_type": "kto"}, "loss_type"),
    (CPOModule, {"beta": 0.0}, "beta"),
    (CPOModule, {"cpo_alpha": -1.0}, "cpo_alpha"),
    (CPOModule, {"label_smoothing": 0.5}, "label_smoothing"),
    (CPOModule, {"loss_type": "hinge", "label_smoothing": 0.1}, "label_smoothing"),
    (CPOModule, {"loss_type": "ipo", "label_smoothing": 0.1}, "label_smoothing"),
    (CPOModule, {"loss_type": "simpo", "simpo_gamma": 0.5, "gamma_beta_ratio": 0.25}, "not both"),
    (CPOModule, {"loss_type": "sigmoid", "simpo_gamma": 0.5}, "simpo_gamma"),
    (CPOModule, {"loss_type": "hinge", "gamma_beta_ratio": 0.25}, "gamma_beta_ratio"),
    (CPOModule, {"loss_type": "simpo", "simpo_gamma": -0.1}, "simpo_gamma"),
    (ORPOModule, {"beta": -0.1}, "beta"),
]


@pytest.mark.parametrize(("cls", "options", "match"), BAD_OPTIONS)
def test_bad_options_are_refused_before_the_model_is_built(cls, options, match):
    factory = _NoModel()
    with pytest.raises(ValueError, match=match) as err:
        cls(model=factory, **options)
    assert cls.__name__[:-6] in str(err.value)  # "CPO ..." / "ORPO ..."
    assert not factory.called


def test_gamma_beta_ratio_is_simpo_gamma_over_beta():
    make = functools.partial(CPOModule, model=functools.partial(preset_model, "tiny"))
    assert make(loss_type="simpo", beta=2.0, gamma_beta_ratio=0.25).simpo_gamma == 0.5
    assert make(loss_type="simpo", beta=2.5, simpo_gamma=1.0).simpo_gamma == 1.0
    assert make(loss_type="simpo").simpo_gamma == 0.5  # TRL's default
    module = make(loss_type="simpo", beta=2.0, gamma_beta_ratio=0.25)
    assert module.reduction == "mean" and make(loss_type="sigmoid").reduction == "sum"


# ------------------------------------------------------------------ formulas


def test_cpo_losses_follow_their_formulas():
    pc, pr = torch.tensor([-1.0, -2.5, -0.4]), torch.tensor([-1.5, -2.0, -1.9])
    beta, eps, gamma = 0.7, 0.2, 0.3
    z = (pc - pr).tolist()
    expected = {
        "sigmoid": [
            -(1 - eps) * math.log(_sig(beta * v)) - eps * math.log(_sig(-beta * v)) for v in z
        ],
        "hinge": [max(0.0, 1 - beta * v) for v in z],
        "ipo": [(v - 1 / (2 * beta)) ** 2 for v in z],
        "simpo": [
            -(1 - eps) * math.log(_sig(beta * v - gamma)) - eps * math.log(_sig(gamma - beta * v))
            for v in z
        ],
    }
    for loss_type, values in expected.items():
        ls = eps if loss_type in ("sigmoid", "simpo") else 0.0
        loss, cr, rj = cpo_loss(
            pc, pr, loss_type=loss_type, beta=beta, label_smoothing=ls, simpo_gamma=gamma
        )
        assert loss.item() == pytest.approx(sum(values) / 3, rel=1e-6), loss_type
        assert cr.tolist() == pytest.approx((beta * pc).tolist())
        assert rj.tolist() == pytest.approx((beta * pr).tolist())


def test_orpo_log_odds_and_stable_log1mexp():
    pc, pr = torch.tensor([-0.3, -2.0]), torch.tensor([-1.1, -0.05])
    odds = lambda lp: math.log(math.exp(lp) / (1 - math.exp(lp)))  # noqa: E731
    expected = [odds(a) - odds(b) for a, b in zip(pc.tolist(), pr.tolist())]
    assert orpo_log_odds(pc, pr).tolist() == pytest.approx(expected, rel=1e-5)
    # near 0 and far below it, where the naive log(1 - exp(x)) loses everything
    x = torch.tensor([-1e-10, -1e-3, -math.log(2), -5.0, -60.0], dtype=torch.float64)
    x.requires_grad_(True)
    y = log1mexp(x)
    assert y.tolist() == pytest.approx(
        [
            math.log(1e-10),
            math.log(-math.expm1(-1e-3)),
            -math.log(2),
            math.log1p(-math.exp(-5)),
            -math.exp(-60),
        ],
        rel=1e-9,
    )
    y.sum().backward()
    assert torch.isfinite(x.grad).all()


def test_orpo_nll_labels_cover_the_prompt():
    """Next-token labels over the whole real sequence; the batch's labels keep only the
    response (and the last token, which is not among the inputs)."""
    ids = torch.tensor([[5, 6, 7, 8, 0, 0], [5, 6, 7, 8, 9, 4]])
    attn = torch.tensor([[1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1]])
    labels = torch.tensor([[-100, -100, 8, 3, -100, -100], [-100, -100, -100, 9, 4, 2]])
    batch = {"chosen_input_ids": ids, "chosen_attention_mask": attn, "chosen_labels": labels}
    full = full_sequence_labels(batch, "chosen")
    assert full.tolist() == [[6, 7, 8, 3, -100, -100], [6, 7, 8, 9, 4, 2]]


# ------------------------------------------------------------------ configs


@pytest.mark.parametrize(
    ("name", "cls", "expected"),
    [
        (
            "simpo",
            CPOModule,
            {"loss_type": "simpo", "beta": 2.0, "simpo_gamma": 0.5, "cpo_alpha": 0.0},
        ),
        ("cpo", CPOModule, {"loss_type": "sigmoid", "beta": 0.1, "cpo_alpha": 1.0}),
        ("orpo", ORPOModule, {"beta": 0.1}),
    ],
)
def test_strategy_configs_build_the_modules(name, cls, expected):
    from hydra.utils import instantiate

    from astrai.train.runner import compose

    cfg = compose([f"strategy={name}", "paths.output_dir=/tmp/unused"])
    module = instantiate(cfg.strategy, model=functools.partial(preset_model, "tiny"))
    assert type(module) is cls and module.reference is None
    for key, value in expected.items():
        assert getattr(module, key) == value, key
    # TRL's defaults where the config does not follow the SimPO paper
    assert cfg.strategy.get("label_smoothing", 0.0) == 0.0


# ------------------------------------------------------------------ no reference, training


@pytest.fixture(scope="module")
def pref_data(tmp_path_factory):
    """A tokenizer trained on the arithmetic chats and prepared preference pairs."""
    from astrai.data.builtin import arithmetic_problems, sft_records
    from astrai.data.prepare import prepare
    from astrai.tokenizer import AutoTokenizer

    root = tmp_path_factory.mktemp("reference_free")
    texts = [m["content"] for r in sft_records(arithmetic_problems(200)) for m in r["messages"]]
    tok = AutoTokenizer.train(texts * 2, vocab_size=300)
    tok.save_pretrained(root / "tok")
    for split, n in (("train", 32), ("val", 8)):
        prepare(
            "preference",
            f"builtin:arithmetic/preference/{split}",
            root,
            root / "tok",
            name=f"pref_{split}",
            builtin={"n": n, "seed": 0},
            progress=False,
        )
    return root, len(tok)


def _datamodule(root):
    from astrai.data import AstraiDataModule, PreferenceDataset

    return AstraiDataModule(
        train=PreferenceDataset(str(root / "pref_train.h5")),
        val=PreferenceDataset(str(root / "pref_val.h5")),
        batch_size=8,
        seed=0,
    )


def _policy_only(module) -> None:
    """No second model anywhere: one submodule, the policy; no frozen copy on the side."""
    assert module.reference is None
    assert list(module.children()) == [module.model]
    assert not [v for v in vars(module).values() if isinstance(v, (ReferencePolicy, nn.Module))]
    assert set(module.state_dict()) == {f"model.{k}" for k in module.model.state_dict()}


@pytest.mark.parametrize(
    ("cls", "options"),
    [
        (CPOModule, {"loss_type": "simpo", "beta": 2.0, "cpo_alpha": 0.0}),
        (ORPOModule, {"beta": 0.1}),
    ],
)
def test_no_reference_and_a_few_steps_lower_the_loss(pref_data, tmp_path, cls, options):
    root, vocab = pref_data
    torch.manual_seed(0)
    module = cls(
        model=functools.partial(preset_model, "tiny", vocab_size=vocab),
        optimizer=functools.partial(adamw, lr=1e-2),
        scheduler=constant,
        tokenizer=str(root / "tok"),
        **options,
    )
    assert isinstance(module.model, Transformer)
    _policy_only(module)
    dm = _datamodule(root)
    dm.setup()
    batch = next(iter(dm.train_dataloader()))
    with torch.no_grad():
        before, _ = module.compute_loss(batch)
    trainer = quiet_trainer(
        default_root_dir=tmp_path,
        max_steps=8,
        enable_checkpointing=True,
        num_sanity_val_steps=0,
        limit_val_batches=1,
        val_check_interval=8,
        check_val_every_n_epoch=None,
        use_distributed_sampler=False,
    )
    trainer.fit(module, datamodule=_datamodule(root))
    with torch.no_grad():
        after, metrics = module.compute_loss(batch)
    assert after.item() < before.item()
    assert {"rewards/accuracy", "rewards/margin", "logps/chosen", "nll_loss"} <= set(metrics)
    _policy_only(module)
    ckpt = torch.load(
        sorted(glob.glob(f"{tmp_path}/**/*.ckpt", recursive=True))[-1], weights_only=False
    )
    assert set(ckpt["state_dict"]) == {f"model.{k}" for k in module.model.state_dict()}
    assert "dpo_reference" not in ckpt
    assert not [k for k in ckpt if "reference" in k]
