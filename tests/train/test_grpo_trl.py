"""Our GRPO loss against TRL's own: every ``loss_type`` is computed by TRL 1.16's
``GRPOTrainer._compute_loss`` (a real trainer on a tiny random local Llama) from the same
per-token log-probs, old and reference log-probs, advantages and completion masks, and must
match ours in value, gradient and clip-ratio metrics. And TRL's dapo normaliser over a
simulated two-rank split (gradient accumulation under Lightning: test_grpo.py)."""

from __future__ import annotations

import pytest
import torch

trl = pytest.importorskip("trl")

from trl_helpers import grpo_trainer, hf_parts, trl_loss  # noqa: E402

from astrai.train.strategies.grpo.loss import LOSS_TYPES, grpo_loss  # noqa: E402

EPSILON, EPSILON_HIGH, BETA, MAX_COMPLETION = 0.2, 0.28, 0.04, 6


@pytest.fixture(scope="module")
def parts(tmp_path_factory):
    return hf_parts(tmp_path_factory.mktemp("trl"))


def _trainer(parts, loss_type: str, bias_correction: bool):
    return grpo_trainer(
        parts,
        f"{loss_type}-{bias_correction}",
        max_completion_length=MAX_COMPLETION,
        beta=BETA,
        epsilon=EPSILON,
        epsilon_high=EPSILON_HIGH,
        loss_type=loss_type,
        use_bias_correction_kl=bias_correction,
    )


def _batch():
    """Four completions of lengths 5, 3, 1 and 4 (padded to 5), ratios on both sides of the
    clip range, advantages of both signs, a reference that differs from the policy."""
    g = torch.Generator().manual_seed(3)
    n, c = 4, 5
    mask = torch.zeros(n, c)
    for i, length in enumerate([5, 3, 1, 4]):
        mask[i, :length] = 1
    logp = -2.0 * torch.rand(n, c, generator=g)
    old = logp + 0.4 * torch.randn(n, c, generator=g)
    ref = logp + 0.3 * torch.randn(n, c, generator=g)
    adv = torch.tensor([1.2, -0.7, 0.5, -1.0])
    return logp, old, ref, adv, mask


@pytest.mark.parametrize("bias_correction", [True, False])
@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_grpo_loss_equals_trl(parts, loss_type, bias_correction):
    trainer = _trainer(parts, loss_type, bias_correction)
    assert (trainer.epsilon_low, trainer.epsilon_high) == (EPSILON, EPSILON_HIGH)
    logp, old, ref, adv, mask = _batch()

    theirs_lp = logp.clone().requires_grad_(True)
    theirs = trl_loss(trainer, theirs_lp, old, ref, adv, mask)
    theirs.backward()

    ours_lp = logp.clone().requires_grad_(True)
    ours, metrics = grpo_loss(
        ours_lp,
        old,
        adv,
        mask,
        loss_type=loss_type,
        epsilon=EPSILON,
        epsilon_high=EPSILON_HIGH,
        ref_logp=ref,
        kl_coef=BETA,
        use_bias_correction_kl=bias_correction,
        max_completion_length=MAX_COMPLETION,
    )
    ours.backward()

    torch.testing.assert_close(ours, theirs.detach(), rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(ours_lp.grad, theirs_lp.grad, rtol=1e-6, atol=1e-8)
    assert ours_lp.grad[2, 1:].eq(0).all()  # padding of the one-token completion
    logged = {k: v[-1] for k, v in trainer._metrics["train"].items()}
    for key in ("clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean", "kl"):
        assert metrics[key].item() == pytest.approx(logged[key], abs=1e-6), key
    # the batch exercises both clip regions and the asymmetric bound
    assert metrics["clip_ratio/low_mean"] > 0 and metrics["clip_ratio/high_mean"] > 0
    ratio = torch.exp(logp - old)[mask.bool()]
    assert ((ratio > 1 + EPSILON) & (ratio <= 1 + EPSILON_HIGH)).any()


def test_the_loss_types_differ_on_this_batch():
    """So the comparison above can tell them apart (different lengths make the aggregations
    disagree); on one batch of one process dapo is bnpo (they part across micro-batches and
    ranks: test_grpo.py)."""
    logp, old, ref, adv, mask = _batch()
    values = {
        lt: grpo_loss(
            logp,
            old,
            adv,
            mask,
            loss_type=lt,
            epsilon=EPSILON,
            epsilon_high=EPSILON_HIGH,
            ref_logp=ref,
            kl_coef=BETA,
            max_completion_length=MAX_COMPLETION,
        )[0].item()
        for lt in LOSS_TYPES
    }
    assert len({round(values[k], 6) for k in ("grpo", "bnpo", "dr_grpo")}) == 3, values
    assert values["dapo"] == pytest.approx(values["bnpo"], rel=1e-6)


def test_dapo_over_two_ranks_equals_one_process():
    """DDP averages the ranks' gradients; with ``num_items`` = global tokens / world size each
    rank's dapo loss averages to the single-process value, in value and gradient, even when
    the ranks hold different numbers of completion tokens (bnpo would not)."""
    g = torch.Generator().manual_seed(0)
    logp = -torch.rand(6, 5, generator=g)
    old = logp + 0.3 * torch.randn(6, 5, generator=g)
    adv = torch.randn(6, generator=g)
    mask = torch.zeros(6, 5)
    for i, n in enumerate([5, 5, 4, 1, 2, 1]):  # rank 0: 14 tokens, rank 1: 4
        mask[i, :n] = 1
    kw = dict(loss_type="dapo", epsilon=0.2, epsilon_high=0.28)
    whole = logp.clone().requires_grad_(True)
    single, _ = grpo_loss(whole, old, adv, mask, **kw)
    single.backward()
    split = logp.clone().requires_grad_(True)
    per_rank = [
        grpo_loss(split[r], old[r], adv[r], mask[r], num_items=mask.sum() / 2, **kw)[0]
        for r in (slice(0, 3), slice(3, 6))
    ]
    ddp = (per_rank[0] + per_rank[1]) / 2
    ddp.backward()
    torch.testing.assert_close(ddp, single)
    torch.testing.assert_close(split.grad, whole.grad)
    bnpo = [
        grpo_loss(logp[r], old[r], adv[r], mask[r], loss_type="bnpo")[0]
        for r in (
            slice(0, 3),
            slice(3, 6),
        )
    ]
    assert not torch.allclose((bnpo[0] + bnpo[1]) / 2, single)
