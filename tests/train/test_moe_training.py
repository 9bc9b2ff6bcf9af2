"""Training a mixture-of-experts model: the loss every strategy minimises includes the router
losses (load balancing, z-loss) with their config coefficients, and train/router/* is logged;
the training forward's log-probs equal the engine's (tests/inference/test_engine_moe.py covers
serving)."""

from __future__ import annotations

import functools

import pytest
import torch
from lightning.pytorch.callbacks import Callback
from torch.utils.data import DataLoader
from train_helpers import memory_logger, quiet_trainer

from astrai.inference import InferenceEngine
from astrai.model import preset_model
from astrai.tokenizer import AutoTokenizer
from astrai.train.module import LMModule, lm_loss, token_logprobs
from astrai.train.optim import adamw, constant

pytestmark = pytest.mark.filterwarnings("ignore:You defined a `validation_step` but have no")


class Tiny(LMModule):
    """Plain LM loss; remembers it so the test can add the router terms by hand."""

    lm_losses: list[float]

    def compute_loss(self, batch):
        loss = lm_loss(self.model(batch["input_ids"]), batch["labels"])[0]
        self.lm_losses.append(loss.item())
        return loss, {}


class Totals(Callback):
    """The loss each step optimised and the router losses of that step's forward."""

    def __init__(self) -> None:
        self.steps: list[tuple[float, float, float]] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        aux, z = pl_module.model.moe_aux_loss()
        self.steps.append((outputs["loss"].item(), aux.item(), z.item()))


def test_short_moe_run_adds_router_losses_and_logs_them() -> None:
    torch.manual_seed(0)
    ids = torch.randint(0, 512, (8, 17))
    data = [{"input_ids": row[:-1], "labels": row[1:]} for row in ids]
    model = functools.partial(
        preset_model, name="tiny-moe", router_aux_loss_coef=0.5, router_z_loss_coef=0.01
    )
    module = Tiny(model=model, optimizer=functools.partial(adamw, lr=1e-2), scheduler=constant)
    module.lm_losses = []
    router_before = module.model.layers[1].mlp.gate.weight.detach().clone()
    logger, totals = memory_logger(), Totals()
    trainer = quiet_trainer(max_steps=3, logger=logger, callbacks=[totals], log_every_n_steps=1)
    trainer.fit(module, DataLoader(data, batch_size=2))
    assert len(totals.steps) == 3
    for lm, (total, aux, z) in zip(module.lm_losses, totals.steps):
        assert aux > 0.9 and z > 0  # num_experts * sum f P >= 1 (equality only when balanced)
        assert total == pytest.approx(lm + 0.5 * aux + 0.01 * z, rel=1e-6)
    rows = [r for r in logger.rows if "train/router/aux_loss" in r]
    assert len(rows) == 3
    for row, (total, aux, z) in zip(rows, totals.steps):
        assert row["train/router/aux_loss"] == pytest.approx(aux, rel=1e-6)
        assert row["train/router/z_loss"] == pytest.approx(z, rel=1e-6)
        assert row["train/loss"] == pytest.approx(total, rel=1e-6)
        assert row["train/router/load_cv/layer_1"] >= 0  # layer 0 is dense in tiny-moe
        assert row["train/router/load_cv"] == pytest.approx(row["train/router/load_cv/layer_1"])
        assert not any(k.startswith("train/router/load_cv/layer_0") for k in row)
    assert not torch.equal(module.model.layers[1].mlp.gate.weight, router_before)  # it trains


def test_flops_count_only_the_active_experts() -> None:
    module = Tiny(model=functools.partial(preset_model, name="tiny-moe"))
    cfg = module.model.config  # one sparse layer: 4 experts of 48, 2 per token
    idle = 2 * 3 * cfg.hidden_size * cfg.moe_intermediate_size
    assert module.flops_per_token == 6.0 * (module.model.num_parameters() - idle)
    dense = Tiny(model=functools.partial(preset_model, name="tiny"))
    assert dense.flops_per_token == 6.0 * dense.model.num_parameters()


def test_dense_model_gets_no_router_terms() -> None:
    torch.manual_seed(0)
    module = Tiny(model=functools.partial(preset_model, name="tiny"))
    module.lm_losses = []
    module.model.train()
    ids = torch.randint(0, 512, (2, 9))
    module.model(ids)
    assert module.model.router_stats() == [] and module.model.moe_aux_loss() is None
    assert module.router_loss() == 0.0


def test_training_logprobs_equal_packed_inference_logprobs() -> None:
    """The dense training forward and the packed cached forward (prefill, then decode) of a
    MoE model give the same log-probs."""
    tok = AutoTokenizer.train(["def f(x):\n    return x + 1\n" * 20], vocab_size=300)
    torch.manual_seed(0)
    model = preset_model("tiny-moe", vocab_size=512, initializer_range=0.1).eval()
    prompts = [[5, 17, 99, 3, 250, 7], list(range(40, 75))]
    with InferenceEngine(model, tok, start=False, cache_mode="paged", page_size=4) as eng:
        out = eng.run_batch(
            prompts, max_tokens=6, temperature=1.0, seed=3, return_logprobs=True, ignore_eos=True
        )
    model.train()  # the training forward, as a strategy runs it
    for p, (ids, lps) in zip(prompts, out):
        logits = model(torch.tensor([p + ids]))[0]
        ref = token_logprobs(logits[None, len(p) - 1 : -1], torch.tensor([ids]))[0]
        torch.testing.assert_close(torch.tensor(lps), ref.detach(), atol=1e-5, rtol=0)
