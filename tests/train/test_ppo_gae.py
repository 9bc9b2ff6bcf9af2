"""PPO's token rewards and GAE against verl's own code, transcribed below.

Source: github.com/volcengine/verl at commit b178a3cd56f58b2d502255daba591e92833930a7
(2026-01-29): ``verl/trainer/ppo/core_algos.py`` (``compute_gae_advantage_return``,
``kl_penalty_forward``), ``verl/trainer/ppo/ray_trainer.py`` (``apply_kl_penalty``: the
token-level rewards ``token_level_scores - beta * kld``) and ``verl/utils/torch_functional.py``
(``masked_mean``, ``masked_var``, ``masked_whiten``). Transcribed as they are (only
``verl_F.`` dropped and the DataProto plumbing of ``apply_kl_penalty`` reduced to its tensors).
"""

from __future__ import annotations

import pytest
import torch

from astrai.train.strategies.ppo.gae import (
    KL_PENALTIES,
    gae_advantage_return,
    kl_penalty,
    token_level_rewards,
)


# ---------------------------------------------------------------------- verl, transcribed
def verl_masked_sum(values, mask, axis=None):
    return (values * mask).sum(axis=axis)


def verl_masked_mean(values, mask, axis=None):
    s = verl_masked_sum(values, mask, axis)
    return s / (mask.sum(axis=axis) + 1e-8)


def verl_masked_var(values, mask, unbiased=True):
    mean = verl_masked_mean(values, mask)
    centered_values = values - mean
    variance = verl_masked_mean(centered_values**2, mask)
    if unbiased:
        mask_sum = mask.sum()
        bessel_correction = mask_sum / (mask_sum - 1)
        variance = variance * bessel_correction
    return variance


def verl_masked_whiten(values, mask, shift_mean=True):
    mean, var = verl_masked_mean(values, mask), verl_masked_var(values, mask)
    whitened = (values - mean) * torch.rsqrt(var + 1e-8)
    if not shift_mean:
        whitened += mean
    return whitened


def verl_compute_gae_advantage_return(token_level_rewards, values, response_mask, gamma, lam):
    with torch.no_grad():
        nextvalues = 0
        lastgaelam = 0
        advantages_reversed = []
        gen_len = token_level_rewards.shape[-1]

        for t in reversed(range(gen_len)):
            delta = token_level_rewards[:, t] + gamma * nextvalues - values[:, t]
            lastgaelam_ = delta + gamma * lam * lastgaelam

            # skip values and TD-error on observation tokens
            nextvalues = values[:, t] * response_mask[:, t] + (1 - response_mask[:, t]) * nextvalues
            lastgaelam = lastgaelam_ * response_mask[:, t] + (1 - response_mask[:, t]) * lastgaelam

            advantages_reversed.append(lastgaelam)
        advantages = torch.stack(advantages_reversed[::-1], dim=1)

        returns = advantages + values
        advantages = verl_masked_whiten(advantages, response_mask)
    return advantages, returns


def verl_kl_penalty_forward(logprob, ref_logprob, kl_penalty):
    if kl_penalty in ("kl", "k1"):
        return logprob - ref_logprob
    if kl_penalty == "abs":
        return (logprob - ref_logprob).abs()
    if kl_penalty in ("mse", "k2"):
        return 0.5 * (logprob - ref_logprob).square()
    if kl_penalty in ("low_var_kl", "k3"):
        kl = ref_logprob - logprob
        kl = torch.clamp(kl, min=-20, max=20)
        ratio = torch.exp(kl)
        kld = (ratio - kl - 1).contiguous()
        return torch.clamp(kld, min=-10, max=10)
    raise NotImplementedError


def verl_apply_kl_penalty(token_level_scores, old_log_probs, ref_log_prob, response_mask, beta, kl):
    kld = verl_kl_penalty_forward(old_log_probs, ref_log_prob, kl_penalty=kl)
    kld = kld * response_mask
    return token_level_scores - beta * kld


# ---------------------------------------------------------------------- fixtures
def _batch(seed: int = 0):
    """Six completions of up to 7 tokens: ragged lengths, one empty, one multi-turn episode
    whose mask has a hole (environment tokens), rewards on the last action token."""
    g = torch.Generator().manual_seed(seed)
    lengths = [7, 3, 5, 1, 0, 7]
    mask = torch.zeros(6, 7)
    for i, n in enumerate(lengths):
        mask[i, :n] = 1.0
    mask[5, 2:4] = 0.0  # an episode: tokens 2-3 are the environment's
    values = torch.randn(6, 7, generator=g) * mask
    outcome = torch.randn(6, generator=g)
    logp = -torch.rand(6, 7, generator=g) * 3
    ref = -torch.rand(6, 7, generator=g) * 3
    return mask, values, outcome, logp, ref


def _verl_scores(outcome, mask):
    """verl's ``token_level_scores``: the reward on the last response token."""
    scores = torch.zeros_like(mask)
    for i in range(mask.shape[0]):
        idx = mask[i].nonzero()
        if len(idx):
            scores[i, idx[-1, 0]] = outcome[i]
    return scores


def test_outcome_reward_sits_on_the_last_action_token():
    mask, _, outcome, _, _ = _batch()
    assert torch.equal(token_level_rewards(outcome, mask), _verl_scores(outcome, mask))


@pytest.mark.parametrize("kind", KL_PENALTIES)
def test_kl_in_reward_equals_verls_apply_kl_penalty(kind):
    mask, _, outcome, logp, ref = _batch(1)
    ours = token_level_rewards(outcome, mask, kl_penalty(logp, ref, kind), 0.05)
    theirs = verl_apply_kl_penalty(_verl_scores(outcome, mask), logp, ref, mask, 0.05, kind)
    torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-7)


@pytest.mark.parametrize("gamma, lam", [(1.0, 1.0), (1.0, 0.95), (0.9, 0.8), (0.99, 0.0)])
def test_gae_equals_verls_compute_gae_advantage_return(gamma, lam):
    mask, values, outcome, logp, ref = _batch(2)
    rewards = token_level_rewards(outcome, mask, kl_penalty(logp, ref, "kl"), 0.1)
    adv, ret = gae_advantage_return(rewards, values, mask, gamma, lam)
    v_adv, v_ret = verl_compute_gae_advantage_return(rewards, values, mask, gamma, lam)
    torch.testing.assert_close(ret, v_ret, rtol=0, atol=1e-6)
    # ours are zeroed off the mask (nothing reads them there); equal on it
    torch.testing.assert_close(adv, v_adv * mask, rtol=0, atol=1e-6)


def test_gae_with_lambda_one_is_the_return_minus_the_value():
    """gamma = lam = 1 with an outcome reward: every action token's raw advantage is the
    reward minus its value (before whitening), the return the reward itself."""
    mask, values, outcome, _, _ = _batch(3)
    _, ret = gae_advantage_return(token_level_rewards(outcome, mask), values, mask, 1.0, 1.0)
    expected = outcome[:, None].expand_as(mask) * mask
    torch.testing.assert_close(ret * mask, expected, rtol=0, atol=1e-6)


def test_a_wrong_estimator_name_is_refused():
    with pytest.raises(ValueError, match="kl_penalty"):
        kl_penalty(torch.zeros(1), torch.zeros(1), "k4")
