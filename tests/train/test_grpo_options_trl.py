"""GRPO's options against their references, on fixed tensors.

- The loss options (``importance_sampling_level``, ``delta``, ``top_entropy_quantile``,
  per-token advantages, ``steps_per_generation``'s dapo normaliser) against TRL 1.16's
  ``GRPOTrainer._compute_loss``: value to 1e-6, gradient to 1e-7, clip metrics.
- ``scale_rewards`` and ``mask_truncated_completions`` against TRL's own
  ``_generate_and_score_completions`` (its generation replaced by our completions).
- RLOO's advantages against TRL's ``RLOOTrainer``; REINFORCE++ against a plain-torch
  transcription of verl's ``core_algos`` formulas.
"""

from __future__ import annotations

import itertools

import pytest
import torch

trl = pytest.importorskip("trl")

from trl_helpers import (  # noqa: E402
    EOS_ID,
    grpo_trainer,
    hf_parts,
    rloo_trainer,
    scored_by_trl,
    trl_loss,
)

from astrai.train.strategies.grpo.advantages import compute_advantages  # noqa: E402
from astrai.train.strategies.grpo.loss import (  # noqa: E402
    LOSS_TYPES,
    grpo_loss,
    high_entropy_mask,
)

EPSILON, EPSILON_HIGH, BETA, MAX_COMPLETION = 0.2, 0.28, 0.04, 6


@pytest.fixture(scope="module")
def parts(tmp_path_factory):
    return hf_parts(tmp_path_factory.mktemp("trl-options"))


def _batch(per_token_adv: bool = False):
    """Four completions of lengths 5, 3, 1 and 4, ratios on both sides of the clip range and
    past ``delta``, advantages of both signs, a reference that differs, spread entropies."""
    g = torch.Generator().manual_seed(5)
    n, c = 4, 5
    mask = torch.zeros(n, c)
    for i, length in enumerate([5, 3, 1, 4]):
        mask[i, :length] = 1
    logp = -2.0 * torch.rand(n, c, generator=g)
    old = logp + 0.6 * torch.randn(n, c, generator=g)
    ref = logp + 0.3 * torch.randn(n, c, generator=g)
    adv = torch.tensor([1.2, -0.7, 0.5, -1.0])
    if per_token_adv:
        adv = adv.unsqueeze(-1) + 0.3 * torch.randn(n, c, generator=g)
    entropies = 3.0 * torch.rand(n, c, generator=g)
    return logp, old, ref, adv, mask, entropies


OPTIONS = {
    "sequence": {"importance_sampling_level": "sequence"},
    "delta": {"delta": 1.5},
    "entropy": {"top_entropy_quantile": 0.4},
    "per_token_adv": {},
    "all": {"importance_sampling_level": "sequence", "delta": 1.5, "top_entropy_quantile": 0.4},
}


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
@pytest.mark.parametrize("option", list(OPTIONS))
def test_loss_options_equal_trl(parts, option, loss_type):
    config = OPTIONS[option]
    trainer = grpo_trainer(
        parts,
        f"{option}-{loss_type}",
        max_completion_length=MAX_COMPLETION,
        beta=BETA,
        epsilon=EPSILON,
        epsilon_high=EPSILON_HIGH,
        loss_type=loss_type,
        **config,
    )
    logp, old, ref, adv, mask, ent = _batch(per_token_adv=option in ("per_token_adv", "all"))

    theirs_lp = logp.clone().requires_grad_(True)
    theirs = trl_loss(trainer, theirs_lp, old, ref, adv, mask, entropies=ent)
    theirs.backward()

    q = config.get("top_entropy_quantile", 1.0)
    keep = high_entropy_mask(ent, mask, q) if q < 1 else None
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
        use_bias_correction_kl=True,
        max_completion_length=MAX_COMPLETION,
        importance_sampling_level=config.get("importance_sampling_level", "token"),
        delta=config.get("delta"),
        entropy_mask=keep,
    )
    ours.backward()

    torch.testing.assert_close(ours, theirs.detach(), rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(ours_lp.grad, theirs_lp.grad, rtol=1e-6, atol=1e-7)
    logged = {k: v[-1] for k, v in trainer._metrics["train"].items()}
    for key in ("clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean", "kl"):
        assert metrics[key].item() == pytest.approx(logged[key], abs=1e-6), key


def test_the_options_change_the_loss():
    """So the comparisons above can tell each option from its absence."""
    logp, old, _, adv, mask, ent = _batch()
    base = dict(loss_type="dapo", epsilon=EPSILON, epsilon_high=EPSILON_HIGH)
    plain = grpo_loss(logp, old, adv, mask, **base)[0]
    assert grpo_loss(logp, old, adv, mask, importance_sampling_level="sequence", **base)[0] != plain
    assert grpo_loss(logp, old, adv, mask, delta=1.5, **base)[0] != plain
    keep = high_entropy_mask(ent, mask, 0.4)
    assert 0 < keep.sum() < mask.sum()
    assert grpo_loss(logp, old, adv, mask, entropy_mask=keep, **base)[0] != plain
    ratio = torch.exp(logp - old)[mask.bool()]
    assert (ratio > 1.5).any()  # delta bites on this batch


@pytest.mark.parametrize(("accumulation", "steps"), [(1, 2), (2, 2), (4, 2)])
def test_dapo_normaliser_with_steps_per_generation_equals_trl(parts, accumulation, steps):
    """TRL spreads the generation batch's token count over its steps_per_generation slices:
    num_items = tokens / processes * gradient_accumulation_steps / steps_per_generation."""
    trainer = grpo_trainer(
        parts,
        f"spg-{accumulation}-{steps}",
        beta=0.0,
        epsilon=EPSILON,
        epsilon_high=EPSILON_HIGH,
        loss_type="dapo",
        gradient_accumulation_steps=accumulation,
        steps_per_generation=steps,
        per_device_train_batch_size=2,
    )
    logp, old, _, adv, mask, _ = _batch()
    generation_tokens = 23.0  # the whole generation batch's completion tokens
    theirs_lp = logp.clone().requires_grad_(True)
    theirs = trl_loss(trainer, theirs_lp, old, None, adv, mask, num_items=generation_tokens)
    theirs.backward()
    ours_lp = logp.clone().requires_grad_(True)
    ours, _ = grpo_loss(
        ours_lp,
        old,
        adv,
        mask,
        loss_type="dapo",
        epsilon=EPSILON,
        epsilon_high=EPSILON_HIGH,
        num_items=generation_tokens * accumulation / steps,
    )
    ours.backward()
    torch.testing.assert_close(ours, theirs.detach(), rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(ours_lp.grad, theirs_lp.grad, rtol=1e-6, atol=1e-7)


# ------------------------------------------------------------------ advantages
def _completions():
    """Three groups of 4: lengths vary, some end with EOS and some are cut (no EOS)."""
    g = torch.Generator().manual_seed(2)
    ids = []
    for i in range(12):
        length = 2 + int(torch.randint(0, 5, (), generator=g))
        body = torch.randint(4, 30, (length,), generator=g).tolist()
        ids.append([*body[:-1], EOS_ID] if i % 3 else body)
    rewards = [1.0, 0.0, 0.5, 0.0, 2.0, 2.0, 2.0, 2.0, -1.0, 0.25, 3.0, 0.0]
    return ids, rewards


@pytest.mark.parametrize(
    ("scale_rewards", "mask_truncated"),
    list(itertools.product(["group", "batch", "none"], [False, True])),
)
def test_scale_rewards_and_mask_truncated_equal_trl(parts, scale_rewards, mask_truncated):
    ids, rewards = _completions()
    trainer = grpo_trainer(
        parts,
        f"scale-{scale_rewards}-{mask_truncated}",
        per_device_train_batch_size=12,
        num_generations=4,
        beta=0.0,
        scale_rewards=scale_rewards,
        mask_truncated_completions=mask_truncated,
    )
    out = scored_by_trl(trainer, ids, rewards)
    ours = compute_advantages(
        torch.tensor(rewards), 4, advantage="grpo", scale_rewards=scale_rewards
    )
    torch.testing.assert_close(ours, out["advantages"], rtol=1e-6, atol=1e-6)
    # our loss mask: the completion's tokens, none for a completion cut by max_new_tokens
    truncated = torch.tensor([c[-1] != EOS_ID for c in ids])
    mask = torch.zeros_like(out["completion_mask"])
    for i, c in enumerate(ids):
        mask[i, : len(c)] = 0 if (mask_truncated and truncated[i]) else 1
    assert torch.equal(mask, out["completion_mask"])
    assert int(out["num_items_in_batch"]) == int(mask.sum())
    assert truncated.any() and not truncated.all()


@pytest.mark.parametrize("normalize", [False, True])
def test_rloo_advantages_equal_trl_rloo_trainer(parts, normalize):
    ids, rewards = _completions()
    trainer = rloo_trainer(
        parts,
        f"{normalize}",
        reward_funcs=lambda completions, **_: [0.0] * len(completions),
        per_device_train_batch_size=12,
        num_generations=4,
        beta=0.0,
        normalize_advantages=normalize,
    )
    out = scored_by_trl(trainer, ids, rewards)
    ours = compute_advantages(
        torch.tensor(rewards),
        4,
        advantage="rloo",
        scale_rewards="batch" if normalize else None,
    )
    torch.testing.assert_close(ours, out["advantages"], rtol=1e-6, atol=1e-6)


# verl's formulas (verl/trainer/ppo/core_algos.py and verl/utils/torch_functional.py),
# transcribed loop by loop: the outcome reward on the last response token, returns summed
# backwards with a reset after EOS, whitened with the masked, Bessel-corrected variance.
def _verl_masked_whiten(values, mask):
    mean = (values * mask).sum() / mask.sum()
    var = (((values - mean) ** 2) * mask).sum() / mask.sum()
    var = var * (mask.sum() / (mask.sum() - 1))
    return (values - mean) * torch.rsqrt(var + 1e-8)


def _verl_reinforce_pp(token_level_rewards, response_mask, gamma):
    returns = torch.zeros_like(token_level_rewards)
    running_return = 0
    for t in reversed(range(token_level_rewards.shape[1])):
        running_return = token_level_rewards[:, t] + gamma * running_return
        returns[:, t] = running_return
        running_return = running_return * response_mask[:, t]
    return _verl_masked_whiten(returns, response_mask) * response_mask


def _verl_reinforce_pp_baseline(token_level_rewards, response_mask, index):
    scores = token_level_rewards.sum(dim=-1)
    groups: dict[int, list[torch.Tensor]] = {}
    for i in range(scores.shape[0]):
        groups.setdefault(index[i], []).append(scores[i])
    means = {k: torch.mean(torch.stack(v)) for k, v in groups.items()}
    scores = torch.stack([scores[i] - means[index[i]] for i in range(scores.shape[0])])
    scores = scores.unsqueeze(-1).tile([1, response_mask.shape[1]]) * response_mask
    return _verl_masked_whiten(scores, response_mask) * response_mask


@pytest.mark.parametrize("gamma", [1.0, 0.9])
def test_reinforce_pp_equals_verl(gamma):
    ids, rewards = _completions()
    lengths = [len(c) for c in ids]
    mask = torch.zeros(len(ids), max(lengths))
    token_rewards = torch.zeros_like(mask)
    for i, n in enumerate(lengths):
        mask[i, :n] = 1
        token_rewards[i, n - 1] = rewards[i]
    ours = compute_advantages(
        torch.tensor(rewards), 4, advantage="reinforce_pp", mask=mask, gamma=gamma
    )
    torch.testing.assert_close(ours, _verl_reinforce_pp(token_rewards, mask, gamma))
    baseline = compute_advantages(
        torch.tensor(rewards), 4, advantage="reinforce_pp_baseline", mask=mask
    )
    index = [i // 4 for i in range(len(ids))]
    torch.testing.assert_close(baseline, _verl_reinforce_pp_baseline(token_rewards, mask, index))
    assert not torch.allclose(ours, baseline)
