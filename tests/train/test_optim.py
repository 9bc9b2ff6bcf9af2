"""Optimizers and LR schedules (astrai.train.optim), called as Hydra builds them: partials."""

from __future__ import annotations

import functools
import itertools
import math

import pytest
import torch

from astrai.model import Transformer, preset
from astrai.train.optim import (
    CombinedOptimizer,
    adamw,
    configure_optimizers,
    constant,
    cosine,
    muon,
    sgd,
    split_params,
    wsd,
)


@pytest.fixture
def model() -> Transformer:
    torch.manual_seed(0)
    return Transformer(preset("tiny"))


def test_split_params_roles(model: Transformer) -> None:
    parts = split_params(model)
    names = {k: [n for n, _ in v] for k, v in parts.items()}
    assert names["embed"] == ["embed_tokens.weight"]  # tied head counted once
    assert all(p.ndim == 2 for _, p in parts["hidden"])
    assert all("proj" in n for n in names["hidden"])
    assert all(p.ndim == 1 for _, p in parts["other"])
    total = sum(p.numel() for v in parts.values() for _, p in v)
    assert total == model.num_parameters()
    with pytest.raises(ValueError, match="no trainable parameters"):
        split_params(torch.nn.Linear(2, 2).requires_grad_(False))


@pytest.mark.parametrize("factory", [adamw, sgd])
def test_decay_on_hidden_matrices_only(model: Transformer, factory) -> None:
    opt = factory(model, lr=1e-3, weight_decay=0.1)
    decay = {g["name"]: g["weight_decay"] for g in opt.param_groups}
    assert decay == {"hidden": 0.1, "embed": 0.0, "other": 0.0}


def test_moe_expert_matrices_are_decayed_and_kept_off_muon() -> None:
    torch.manual_seed(0)
    model = Transformer(preset("tiny-moe"))
    experts = {id(p) for p in model.parameters() if p.ndim == 3}
    assert experts  # stacked [E, out, in] expert weights
    groups = {g["name"]: g for g in adamw(model, lr=1e-3, weight_decay=0.1).param_groups}
    assert groups["experts"]["weight_decay"] == 0.1
    assert {id(p) for p in groups["experts"]["params"]} == experts
    opt = muon(model, lr=1e-3, muon_lr=0.02)
    muon_params = {id(p) for g in opt.optimizers["muon"].param_groups for p in g["params"]}
    adamw_groups = {g["name"]: g for g in opt.optimizers["adamw"].param_groups}
    assert not experts & muon_params  # torch.optim.Muon takes 2-D parameters only
    assert {id(p) for p in adamw_groups["experts"]["params"]} == experts


def test_muon_for_hidden_matrices_adamw_for_the_rest(model: Transformer) -> None:
    opt = muon(model, lr=1e-3, muon_lr=0.02)
    assert isinstance(opt, CombinedOptimizer)
    assert isinstance(opt.optimizers["muon"], torch.optim.Muon)
    assert isinstance(opt.optimizers["adamw"], torch.optim.AdamW)
    muon_params = {id(p) for g in opt.optimizers["muon"].param_groups for p in g["params"]}
    assert all(p.ndim == 2 for p in model.parameters() if id(p) in muon_params)
    assert id(model.embed_tokens.weight) not in muon_params
    # one step changes every parameter; state_dict round-trips through a fresh optimizer
    ids = torch.randint(0, 512, (2, 16))
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    model(ids).logsumexp(-1).mean().backward()
    opt.step()
    opt.zero_grad()
    changed = [n for n, p in model.named_parameters() if not torch.equal(before[n], p)]
    assert len(changed) == len(before)  # Muon moved the matrices, AdamW the rest
    state = opt.state_dict()
    fresh = muon(model, lr=1e-3, muon_lr=0.02)
    fresh.load_state_dict(state)
    for key in opt.optimizers:
        a, b = opt.optimizers[key].state_dict(), fresh.optimizers[key].state_dict()
        assert a["param_groups"] == b["param_groups"]
        for pid in a["state"]:
            for k, v in a["state"][pid].items():
                assert torch.equal(torch.as_tensor(v), torch.as_tensor(b["state"][pid][k]))
    assert len(opt.state) == len(list(model.parameters()))


def test_combined_optimizer_rejects_foreign_state(model: Transformer) -> None:
    opt = muon(model)
    with pytest.raises(ValueError, match=r"was the optim config changed"):
        opt.load_state_dict(torch.optim.AdamW(model.parameters()).state_dict())


def test_schedules_need_the_run_length() -> None:
    for schedule in (cosine, wsd):
        with pytest.raises(ValueError, match=r"trainer\.max_steps"):
            schedule(None)
    with pytest.raises(ValueError, match="decay_shape"):
        wsd(10, decay_shape="poly")


def test_cosine_with_warmup() -> None:
    f = cosine(110, warmup_steps=10, min_lr_ratio=0.1)
    assert f(0) == pytest.approx(0.1)
    assert f(9) == pytest.approx(1.0)
    assert f(10) == pytest.approx(1.0)
    assert f(60) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))
    assert f(110) == pytest.approx(0.1)
    assert f(500) == pytest.approx(0.1)
    values = [f(s) for s in range(10, 111)]
    assert all(a >= b for a, b in itertools.pairwise(values))


def test_warmup_stable_decay() -> None:
    f = wsd(100, warmup_steps=10, decay_fraction=0.2, min_lr_ratio=0.0)
    assert f(4) == pytest.approx(0.5)
    assert all(f(s) == 1.0 for s in range(10, 80))
    assert f(80) == pytest.approx(1 - 1 / 20)
    assert f(99) == pytest.approx(0.0)
    g = wsd(100, decay_steps=50, decay_shape="sqrt")
    assert f(50) == 1.0 and g(50) == pytest.approx(1 - math.sqrt(1 / 50))
    h = wsd(100, decay_steps=50, decay_shape="cosine")
    assert h(74) == pytest.approx(0.5 * (1 + math.cos(math.pi * 25 / 50)))


def test_constant() -> None:
    f = constant(None, warmup_steps=4)
    assert [f(s) for s in range(6)] == pytest.approx([0.25, 0.5, 0.75, 1.0, 1.0, 1.0])


def test_schedule_steps_per_optimizer_step(model: Transformer) -> None:
    out = configure_optimizers(
        model,
        functools.partial(adamw, lr=1.0),
        functools.partial(constant, warmup_steps=4),
        total_steps=10,
    )
    assert out["lr_scheduler"]["interval"] == "step"
    opt, sched = out["optimizer"], out["lr_scheduler"]["scheduler"]
    lrs = []
    for _ in range(5):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert lrs == pytest.approx([0.25, 0.5, 0.75, 1.0, 1.0])
    # no schedule: a flat learning rate
    out = configure_optimizers(model, functools.partial(adamw, lr=0.5))
    assert out["lr_scheduler"]["scheduler"].lr_lambdas[0](0) == 1.0


def test_total_steps_in_the_schedule_config_wins(model: Transformer) -> None:
    schedule = functools.partial(cosine, warmup_steps=0, min_lr_ratio=0.0, total_steps=4)
    out = configure_optimizers(model, adamw, schedule, total_steps=1000)
    fn = out["lr_scheduler"]["scheduler"].lr_lambdas[0]
    assert fn(4) == pytest.approx(0.0)  # the run length is 4, not the trainer's 1000
    unset = functools.partial(cosine, warmup_steps=0, min_lr_ratio=0.0, total_steps=None)
    out = configure_optimizers(model, adamw, unset, total_steps=8)
    assert out["lr_scheduler"]["scheduler"].lr_lambdas[0](4) == pytest.approx(0.5)


def test_muon_schedule_scales_both_learning_rates(model: Transformer) -> None:
    out = configure_optimizers(
        model,
        functools.partial(muon, lr=1e-3, muon_lr=0.02),
        functools.partial(cosine, warmup_steps=0, min_lr_ratio=0.0),
        total_steps=10,
    )
    opt, sched = out["optimizer"], out["lr_scheduler"]["scheduler"]
    for _ in range(5):
        opt.step()
        sched.step()
    lrs = {g["name"]: g["lr"] for g in opt.param_groups}
    assert lrs["hidden"] == pytest.approx(0.01)
    assert lrs["embed"] == pytest.approx(0.5e-3)
