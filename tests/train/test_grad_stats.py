"""Gradient statistics (`train/grad_norm`, `train/grad_max`, `train/grad_nonfinite`) logged at
every optimizer step, equal to a plain-torch computation on the same gradients, with or
without the non-finite guard (in-process, a tiny model, a few CPU steps)."""

from __future__ import annotations

import functools
import math

import pytest
import torch
from lightning.pytorch.callbacks import Callback
from torch.utils.data import DataLoader
from train_helpers import memory_logger, quiet_trainer

from astrai.model import preset_model
from astrai.train.module import LMModule, NonFiniteLossError, grad_stats, lm_loss
from astrai.train.optim import adamw, constant

STATS = ("grad_norm", "grad_max", "grad_nonfinite")
pytestmark = pytest.mark.filterwarnings("ignore:You defined a `validation_step` but have no")


def _reference(grads: list[torch.Tensor]) -> dict[str, float]:
    flat = torch.cat([g.detach().flatten().double() for g in grads])
    return {
        "grad_norm": flat.norm().item(),
        "grad_max": flat.abs().max().item(),
        "grad_nonfinite": float((~flat.isfinite()).sum()),
    }


def test_grad_stats_match_plain_torch() -> None:
    torch.manual_seed(0)
    grads = [torch.randn(5, 7), torch.randn(3) * 40, torch.randn(2, 2, 2).bfloat16()]
    ours, ref = grad_stats(grads), _reference(grads)
    assert ours["grad_max"] == ref["grad_max"] and ours["grad_nonfinite"] == 0
    assert math.isclose(ours["grad_norm"], ref["grad_norm"], rel_tol=1e-6)
    grads[0][1, 2], grads[1][0], grads[1][2] = float("nan"), float("inf"), -float("inf")
    ours = grad_stats(grads)
    assert ours["grad_nonfinite"] == 3 == _reference(grads)["grad_nonfinite"]
    assert not math.isfinite(ours["grad_norm"])


class Tiny(LMModule):
    def compute_loss(self, batch):
        return lm_loss(self.model(batch["input_ids"]), batch["labels"])[0], {}


class Grads(Callback):
    """The plain-torch statistics of the gradients the optimizer step receives (callbacks run
    before the module's hook, both before clipping); `poison_at`: NaN and inf planted in one
    gradient at that step."""

    def __init__(self, poison_at: int | None = None) -> None:
        self.poison_at = poison_at
        self.seen: list[dict[str, float]] = []

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        if trainer.global_step == self.poison_at:
            grad = pl_module.model.embed_tokens.weight.grad
            grad[0, 0], grad[1, 1] = float("nan"), float("inf")
        grads = [p.grad for p in pl_module.model.parameters() if p.grad is not None]
        self.seen.append(_reference(grads))


def _fit(check_grad_finite: bool, poison_at: int | None = None) -> tuple[list, list]:
    torch.manual_seed(0)
    ids = torch.randint(0, 512, (8, 17))
    data = [{"input_ids": row[:-1], "labels": row[1:]} for row in ids]
    module = Tiny(
        model=functools.partial(preset_model, name="tiny"),
        optimizer=functools.partial(adamw, lr=1e-2),
        scheduler=constant,
        check_grad_finite=check_grad_finite,
    )
    logger, grads = memory_logger(), Grads(poison_at)
    trainer = quiet_trainer(
        max_steps=3, logger=logger, callbacks=[grads], log_every_n_steps=1, gradient_clip_val=0.5
    )
    trainer.fit(module, DataLoader(data, batch_size=2))
    logged = [
        {k: row[f"train/{k}"] for k in STATS} for row in logger.rows if "train/grad_norm" in row
    ]
    return logged, grads.seen


@pytest.mark.parametrize("check_grad_finite", [True, False])
def test_every_step_logs_the_statistics_of_its_gradients(check_grad_finite: bool) -> None:
    logged, seen = _fit(check_grad_finite)
    assert len(logged) == len(seen) == 3
    for ours, ref in zip(logged, seen):
        assert ours["grad_max"] == pytest.approx(ref["grad_max"], rel=1e-6)
        assert ours["grad_norm"] == pytest.approx(ref["grad_norm"], rel=1e-5)
        assert ours["grad_nonfinite"] == 0
        assert ref["grad_norm"] > 0.5  # clipped afterwards: the logged norm is the one before


def test_non_finite_gradients_are_counted_and_stop_only_with_the_guard() -> None:
    """Planted in the last step (the weights it makes are NaN): counted, and without the
    guard the step goes ahead."""
    logged, seen = _fit(check_grad_finite=False, poison_at=2)
    assert [row["grad_nonfinite"] for row in logged] == [0, 0, 2]
    assert seen[2]["grad_nonfinite"] == 2
    with pytest.raises(NonFiniteLossError, match="the gradient norm is nan at global step 2"):
        _fit(check_grad_finite=True, poison_at=2)
