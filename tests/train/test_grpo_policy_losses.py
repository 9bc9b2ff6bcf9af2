"""The newer GRPO objectives (policy_losses.py) against their references on fixed tensors:
``cispo`` and ``sapo``, ``entropy_coef`` and ``off_policy_mask_threshold`` through TRL 1.16's own
``GRPOTrainer._compute_loss`` / ``get_off_policy_mask``; ``gmpo``, ``clip_cov`` and ``kl_cov``
against verl's functions, transcribed below from ``verl/trainer/ppo/core_algos.py``
(``compute_policy_loss_geo_mean``, ``compute_policy_loss_clip_cov``,
``compute_policy_loss_kl_cov``, ``agg_loss``). Loss and gradient w.r.t. logp to 1e-6. Then the
options' checks and a short end-to-end run of each new ``loss_type``."""

from __future__ import annotations

import pytest
import torch

trl = pytest.importorskip("trl")

from grpo_helpers import fit_one_canned_step, make_grpo, prompt_data  # noqa: E402
from trl_helpers import grpo_trainer, hf_parts, trl_loss  # noqa: E402

from astrai.train.strategies.grpo.loss import grpo_loss, high_entropy_mask  # noqa: E402
from astrai.train.strategies.grpo.options import GRPOOptions  # noqa: E402
from astrai.train.strategies.grpo.policy_losses import (  # noqa: E402
    PolicyLossParams,
    off_policy_mask,
)

BETA, MAX_COMPLETION = 0.04, 6
NEW = ("cispo", "sapo", "gmpo", "geo_mean", "clip_cov", "kl_cov")


@pytest.fixture(scope="module")
def parts(tmp_path_factory):
    return hf_parts(tmp_path_factory.mktemp("trl"))


def _batch(seed: int = 3):
    """Four completions of lengths 5, 3, 1 and 4 (padded to 5); ratios spread on both sides of
    1, advantages of both signs, a reference apart from the policy, random entropies."""
    g = torch.Generator().manual_seed(seed)
    n, c = 4, 5
    mask = torch.zeros(n, c)
    for i, length in enumerate([5, 3, 1, 4]):
        mask[i, :length] = 1
    logp = -2.0 * torch.rand(n, c, generator=g)
    old = logp + 0.4 * torch.randn(n, c, generator=g)
    ref = logp + 0.3 * torch.randn(n, c, generator=g)
    adv = torch.tensor([1.2, -0.7, 0.5, -1.0])
    ent = 2.0 * torch.rand(n, c, generator=g)
    return logp, old, ref, adv, mask, ent


def _close(a, b):
    torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


# ---- TRL: cispo, sapo, entropy_coef, off_policy_mask_threshold --------------------------

TRL_CASES = [
    ("cispo", dict(epsilon_high=1.2), {}),
    ("cispo", dict(epsilon_high=1.2, beta=BETA), {"ref": True}),
    ("cispo", dict(epsilon_high=1.2, beta=BETA, entropy_coef=0.05, top_entropy_quantile=0.5), {}),
    ("sapo", dict(), {}),
    ("sapo", dict(sapo_temperature_pos=0.7, sapo_temperature_neg=2.0, beta=BETA), {}),
    ("sapo", dict(entropy_coef=0.1, off_policy_mask_threshold=0.05), {}),
    ("sapo", dict(importance_sampling_level="sequence", beta=BETA), {"is_ratio": True}),
    ("dapo", dict(entropy_coef=0.1, epsilon_high=0.28), {}),
    ("grpo", dict(entropy_coef=0.1, top_entropy_quantile=0.4, beta=BETA), {}),
    ("dapo", dict(off_policy_mask_threshold=0.05, delta=1.5), {}),
    ("cispo", dict(epsilon_high=1.2, off_policy_mask_threshold=0.05), {"is_ratio": True}),
]


@pytest.mark.parametrize("loss_type,config,extra", TRL_CASES)
def test_loss_and_gradients_equal_trl(parts, loss_type, config, extra):
    config = {"epsilon": 0.2, "beta": 0.0, **config}
    trainer = grpo_trainer(
        parts,
        f"{loss_type}-{sorted(config.items())}",
        max_completion_length=MAX_COMPLETION,
        loss_type=loss_type,
        **config,
    )
    logp, old, ref, adv, mask, ent = _batch()
    is_ratio = torch.exp(0.2 * torch.randn(*mask.shape)) if extra.get("is_ratio") else None

    theirs_lp, theirs_ent = logp.clone().requires_grad_(True), ent.clone().requires_grad_(True)
    theirs = trl_loss(
        trainer, theirs_lp, old, ref, adv, mask, entropies=theirs_ent, is_ratio=is_ratio
    )
    theirs.backward()

    quantile = config.get("top_entropy_quantile", 1.0)
    keep = high_entropy_mask(ent, mask, quantile) if quantile < 1.0 else None
    ours_lp, ours_ent = logp.clone().requires_grad_(True), ent.clone().requires_grad_(True)
    threshold = config.get("off_policy_mask_threshold")
    opsm = None if threshold is None else off_policy_mask(adv, ours_lp, old, mask, threshold)
    params = PolicyLossParams(
        sapo_temperature_pos=config.get("sapo_temperature_pos", 1.0),
        sapo_temperature_neg=config.get("sapo_temperature_neg", 1.05),
    )
    ours, metrics = grpo_loss(
        ours_lp,
        old,
        adv,
        mask,
        loss_type=loss_type,
        epsilon=0.2,
        epsilon_high=config.get("epsilon_high"),
        ref_logp=ref,
        kl_coef=config["beta"],
        use_bias_correction_kl=True,
        max_completion_length=MAX_COMPLETION,
        delta=config.get("delta"),
        importance_sampling_level=config.get("importance_sampling_level", "token"),
        entropy_mask=keep,
        is_weight=is_ratio,
        params=params,
        entropies=ours_ent,
        entropy_coef=config.get("entropy_coef", 0.0),
        off_policy_mask=opsm,
    )
    ours.backward()
    _close(ours, theirs.detach())
    _close(ours_lp.grad, theirs_lp.grad)
    _close(ours_ent.grad, theirs_ent.grad)
    assert ours_lp.grad.abs().sum() > 0
    if config.get("entropy_coef"):
        assert ours_ent.grad.abs().sum() > 0  # the bonus's gradient flows through the entropy
    if threshold is not None:
        assert 0 < opsm.sum() < len(opsm)  # the mask drops some sequences, not all
    logged = {k: v[-1] for k, v in trainer._metrics["train"].items()}
    if loss_type == "cispo":
        assert metrics["clip_ratio/high_mean"].item() == pytest.approx(
            logged["cispo_clip_ratio"], abs=1e-6
        )
        assert logged["cispo_clip_ratio"] > 0
    if loss_type in ("dapo", "grpo"):
        assert metrics["clip_ratio/region_mean"].item() == pytest.approx(
            logged["clip_ratio/region_mean"], abs=1e-6
        )


def test_cispo_global_normaliser_equals_trl(parts):
    """cispo divides by TRL's num_items_in_batch (the step's global tokens), as dapo."""
    trainer = grpo_trainer(
        parts,
        "cispo-items",
        max_completion_length=MAX_COMPLETION,
        loss_type="cispo",
        epsilon_high=1.2,
        beta=0.0,
    )
    logp, old, ref, adv, mask, _ = _batch()
    theirs_lp = logp.clone().requires_grad_(True)
    theirs = trl_loss(trainer, theirs_lp, old, ref, adv, mask, num_items=40.0)
    theirs.backward()
    ours_lp = logp.clone().requires_grad_(True)
    ours, _ = grpo_loss(
        ours_lp, old, adv, mask, loss_type="cispo", epsilon_high=1.2, num_items=40.0
    )
    ours.backward()
    _close(ours, theirs.detach())
    _close(ours_lp.grad, theirs_lp.grad)


def test_off_policy_mask_equals_trl():
    logp, old, _, adv, mask, _ = _batch()
    for threshold in (0.01, 0.05, 0.5):
        for a in (adv, adv.unsqueeze(-1).expand_as(mask) * torch.rand(*mask.shape)):
            theirs = trl.GRPOTrainer.get_off_policy_mask(
                advantages=a if a.dim() == 2 else a.unsqueeze(1),
                per_token_logps=logp,
                sampling_per_token_logps=old,
                mask=mask,
                off_policy_threshold=threshold,
            )
            torch.testing.assert_close(off_policy_mask(a, logp, old, mask, threshold), theirs)


# ---- verl: geo_mean (gmpo), clip_cov, kl_cov (transcribed) -------------------------------


def _verl_masked_mean(values, mask):
    """verl.utils.torch_functional.masked_mean."""
    return (values * mask).sum() / (mask.sum() + 1e-8)


def verl_geo_mean(old_log_prob, log_prob, advantages, response_mask, cliprange_low, cliprange_high):
    """verl core_algos.compute_policy_loss_geo_mean (no rollout_is_weights)."""
    negative_approx_kl = log_prob - old_log_prob
    sgn_advantage = torch.sign(advantages)
    negative_approx_kl_clamp = torch.clamp(negative_approx_kl, -cliprange_low, cliprange_high)
    negative_approx_kl_min = torch.min(
        sgn_advantage * negative_approx_kl, sgn_advantage * negative_approx_kl_clamp
    )
    negative_approx_kl_min = sgn_advantage * negative_approx_kl_min
    response_mask_sum = response_mask.sum(dim=-1)
    ratio = torch.exp(
        (negative_approx_kl_min * response_mask).sum(dim=-1) / (response_mask_sum + 1e-8)
    )
    advantage = (advantages * response_mask).sum(dim=-1) / (response_mask_sum + 1e-8)
    pg_losses = -advantage * ratio
    clipped = torch.ne(negative_approx_kl, negative_approx_kl_clamp)
    clipfrac = _verl_masked_mean((clipped * (advantages > 0)).float(), response_mask)
    return torch.mean(pg_losses), clipfrac


def verl_clip_cov(
    old_log_prob,
    log_prob,
    advantages,
    response_mask,
    cliprange_low,
    cliprange_high,
    clip_cov_ratio,
    clip_cov_lb,
    clip_cov_ub,
):
    """verl core_algos.compute_policy_loss_clip_cov, loss_agg_mode token-mean (agg_loss)."""
    negative_approx_kl = log_prob - old_log_prob
    ratio = torch.exp(negative_approx_kl)
    pg_losses1 = -advantages * ratio
    corr = torch.ones_like(advantages)
    pg_losses2 = -advantages * torch.clamp(ratio, 1 - cliprange_low, 1 + cliprange_high)
    clip_by_origin = (pg_losses2 > pg_losses1) & (response_mask > 0)
    cov_all = (advantages - _verl_masked_mean(advantages, response_mask)) * (
        log_prob - _verl_masked_mean(log_prob.detach(), response_mask)
    )
    cov_all[response_mask == 0] = -torch.inf
    cov_all[clip_by_origin] = -torch.inf
    clip_num = max(int(clip_cov_ratio * response_mask.sum().item()), 1)
    top_k_idx = (cov_all < clip_cov_ub) & (cov_all > clip_cov_lb) & (response_mask > 0)
    top_k_idx = torch.nonzero(top_k_idx)
    if len(top_k_idx) > 0:
        perm = torch.randperm(len(top_k_idx))
        top_k_idx = top_k_idx[perm[: min(clip_num, len(top_k_idx))]]
    else:
        top_k_idx = torch.empty((0, 2), device=cov_all.device, dtype=torch.long)
    corr[top_k_idx[:, 0], top_k_idx[:, 1]] = 0
    pg_losses = torch.maximum(pg_losses1, pg_losses2) * corr
    return (pg_losses * response_mask).sum() / response_mask.sum(), corr


def verl_kl_cov(old_log_prob, log_prob, advantages, response_mask, kl_cov_ratio, ppo_kl_coef):
    """verl core_algos.compute_policy_loss_kl_cov, loss_agg_mode token-mean (agg_loss)."""
    negative_approx_kl = log_prob - old_log_prob
    abs_kl = negative_approx_kl.abs()
    ratio = torch.exp(negative_approx_kl)
    pg_losses1 = -advantages * ratio
    pg_losses_kl = -advantages * ratio + ppo_kl_coef * abs_kl
    pg_losses = pg_losses1
    all_valid = response_mask > 0
    all_valid_idx = torch.nonzero(all_valid.reshape(-1), as_tuple=True)[0]
    all_valid_adv = advantages[all_valid].detach().reshape(-1).cpu()
    all_valid_logp = log_prob[all_valid].detach().reshape(-1).cpu()
    k = min(kl_cov_ratio, len(all_valid_adv))
    if k != 0:
        cov_lst_all = (all_valid_adv - all_valid_adv.mean()) * (
            all_valid_logp - all_valid_logp.mean()
        )
        k_percent_nums = max(1, int(len(cov_lst_all) * kl_cov_ratio))
        large_cov_idxs = torch.topk(cov_lst_all, k_percent_nums, largest=True).indices
        if len(large_cov_idxs) != 0:
            large_cov_idxs = all_valid_idx[large_cov_idxs]
            w = advantages.shape[1]
            pg_losses[large_cov_idxs // w, large_cov_idxs % w] = pg_losses_kl[
                large_cov_idxs // w, large_cov_idxs % w
            ]
    return (pg_losses * response_mask).sum() / response_mask.sum()


def _ours(loss_type, logp, old, adv, mask, **params):
    lp = logp.clone().requires_grad_(True)
    eps = params.pop("epsilon", 0.2)
    eps_high = params.pop("epsilon_high", 0.28)
    loss, metrics = grpo_loss(
        lp,
        old,
        adv,
        mask,
        loss_type=loss_type,
        epsilon=eps,
        epsilon_high=eps_high,
        params=PolicyLossParams(**params),
    )
    loss.backward()
    return loss, lp.grad, metrics


@pytest.mark.parametrize("loss_type", ["gmpo", "geo_mean"])
@pytest.mark.parametrize("per_token", [False, True])
@pytest.mark.parametrize("seed", [3, 4])
def test_gmpo_equals_verl_geo_mean(loss_type, per_token, seed):
    logp, old, _, adv, mask, _ = _batch(seed)
    adv_t = adv.unsqueeze(-1).expand_as(mask).clone()
    if per_token:  # verl takes [N, T]; the mean of a sign-constant row is the sequence's
        adv_t = adv_t * (0.5 + torch.rand(*mask.shape))
    theirs_lp = logp.clone().requires_grad_(True)
    theirs, clipfrac = verl_geo_mean(old, theirs_lp, adv_t, mask, 0.2, 0.28)
    theirs.backward()
    ours, grad, metrics = _ours(loss_type, logp, old, adv_t if per_token else adv, mask)
    _close(ours, theirs.detach())
    _close(grad, theirs_lp.grad)
    _close(metrics["clip_ratio/high_mean"], clipfrac)
    assert 0 < metrics["clip_ratio/region_mean"] < 1


@pytest.mark.parametrize("seed", [3, 4, 5])
def test_clip_cov_equals_verl(seed):
    """Every candidate is taken (clip_cov_ratio large enough), so verl's random draw among
    them is no draw; a window that holds some of the tokens."""
    logp, old, _, adv, mask, _ = _batch(seed)
    adv_t = adv.unsqueeze(-1).expand_as(mask)
    kw = dict(clip_cov_ratio=1.0, clip_cov_lb=0.05, clip_cov_ub=5.0)
    theirs_lp = logp.clone().requires_grad_(True)
    theirs, corr = verl_clip_cov(old, theirs_lp, adv_t, mask, 0.2, 0.28, **kw)
    theirs.backward()
    assert 0 < (corr[mask.bool()] == 0).sum() < mask.sum()  # some tokens cut, not all
    ours, grad, _ = _ours("clip_cov", logp, old, adv, mask, **kw)
    _close(ours, theirs.detach())
    _close(grad, theirs_lp.grad)


def test_clip_cov_cuts_the_stated_number_replayably():
    logp, old, _, adv, mask, _ = _batch()
    kw = dict(clip_cov_ratio=0.1, clip_cov_lb=0.0, clip_cov_ub=5.0)  # 13 tokens: 1 cut
    _, grad_a, _ = _ours("clip_cov", logp, old, adv, mask, **kw)
    _, grad_b, _ = _ours("clip_cov", logp, old, adv, mask, **kw)
    _, grad_ppo, _ = _ours("dapo", logp, old, adv, mask)
    torch.testing.assert_close(grad_a, grad_b)
    cut = (grad_ppo != 0) & (grad_a == 0)
    assert cut.sum() == 1


@pytest.mark.parametrize("ratio,coef", [(0.0002, 1.0), (0.2, 1.0), (0.5, 3.0)])
def test_kl_cov_equals_verl(ratio, coef):
    logp, old, _, adv, mask, _ = _batch()
    adv_t = adv.unsqueeze(-1).expand_as(mask)
    theirs_lp = logp.clone().requires_grad_(True)
    theirs = verl_kl_cov(old, theirs_lp, adv_t, mask, ratio, coef)
    theirs.backward()
    ours, grad, _ = _ours("kl_cov", logp, old, adv, mask, kl_cov_ratio=ratio, ppo_kl_coef=coef)
    _close(ours, theirs.detach())
    _close(grad, theirs_lp.grad)


def test_the_new_losses_differ_on_this_batch():
    logp, old, _, adv, mask, _ = _batch()
    values = {lt: _ours(lt, logp, old, adv, mask)[0].item() for lt in NEW if lt != "geo_mean"}
    values["dapo"] = _ours("dapo", logp, old, adv, mask)[0].item()
    assert len({round(v, 6) for v in values.values()}) == len(values), values


# ---- options -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kw,key",
    [
        ({"loss_type": "ppo"}, "loss_type"),
        ({"loss_type": "sapo", "sapo_temperature_pos": 0.0}, "sapo_temperature_pos"),
        ({"loss_type": "sapo", "sapo_temperature_neg": -1.0}, "sapo_temperature_neg"),
        ({"loss_type": "clip_cov", "clip_cov_ratio": 0.0}, "clip_cov_ratio"),
        ({"loss_type": "clip_cov", "clip_cov_ratio": 1.5}, "clip_cov_ratio"),
        ({"loss_type": "clip_cov", "clip_cov_lb": 5.0, "clip_cov_ub": 1.0}, "clip_cov_lb"),
        ({"loss_type": "kl_cov", "kl_cov_ratio": 2.0}, "kl_cov_ratio"),
        ({"loss_type": "kl_cov", "ppo_kl_coef": -1.0}, "ppo_kl_coef"),
        ({"entropy_coef": -0.1}, "entropy_coef"),
        ({"off_policy_mask_threshold": 0.0}, "off_policy_mask_threshold"),
        (
            {"loss_type": "cispo", "importance_sampling_level": "sequence"},
            "importance_sampling_level",
        ),
    ],
)
def test_bad_values_fail_in_parse_naming_the_key(kw, key):
    with pytest.raises(ValueError, match=key):
        GRPOOptions.parse(rewards=["exact_match"], **kw)


def test_options_carry_the_parameters():
    o = GRPOOptions.parse(
        rewards=["exact_match"],
        loss_type="geo_mean",
        sapo_temperature_neg=2.0,
        kl_cov_ratio=0.1,
        off_policy_mask_threshold=0.5,
    )
    p = o.policy_loss
    assert (p.sapo_temperature_neg, p.kl_cov_ratio) == (2.0, 0.1)
    assert (o.entropy_coef, o.off_policy_mask_threshold) == (0.0, 0.5)


# ---- end to end --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def prompt_setup(tmp_path_factory):
    return prompt_data(tmp_path_factory.mktemp("grpo_losses"))


@pytest.mark.parametrize(
    "loss_type,extra",
    [
        ("cispo", {"epsilon_high": 5.0}),
        ("sapo", {"off_policy_mask_threshold": 0.5}),
        ("gmpo", {}),
        ("clip_cov", {"clip_cov_ratio": 0.1, "clip_cov_lb": 0.0}),
        ("kl_cov", {"kl_cov_ratio": 0.1}),
    ],
)
def test_each_new_loss_trains(prompt_setup, tmp_path, loss_type, extra):
    import lightning as L
    from lightning.pytorch.loggers import CSVLogger

    from astrai.data import AstraiDataModule, PromptDataset

    root, tok = prompt_setup
    module = make_grpo(root, tok, loss_type=loss_type, **extra)
    dm = AstraiDataModule(train=PromptDataset(str(root / "prompts.h5")), batch_size=2, seed=0)
    trainer = L.Trainer(
        default_root_dir=tmp_path,
        max_steps=2,
        accelerator="cpu",
        logger=CSVLogger(tmp_path),
        log_every_n_steps=1,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
        use_distributed_sampler=False,
    )
    trainer.fit(module, datamodule=dm)
    logged = trainer.logged_metrics
    for key in ("train/loss", "train/kl", "train/ratio", "train/entropy"):
        assert key in logged, key
        assert torch.isfinite(torch.as_tensor(logged[key])), key
    if loss_type in ("cispo", "gmpo", "clip_cov"):
        assert "train/clip_ratio/high_mean" in logged
    assert trainer.global_step == 2
    assert all(torch.isfinite(p).all() for p in module.model.parameters())


@pytest.mark.parametrize(
    "options",
    [
        {"loss_type": "cispo", "epsilon_high": 1.1},
        {"loss_type": "kl_cov", "ppo_kl_coef": 0.0},  # the per-micro-batch top-k aside
        {"loss_type": "clip_cov", "clip_cov_lb": 4.9},  # no token in the window
    ],
)
def test_global_token_losses_under_accumulation_equal_one_batch(prompt_setup, options):
    """cispo, clip_cov and kl_cov normalise like dapo (GlobalTokenNormaliser): two
    micro-batches of different token counts give the SGD step of one batch of both."""
    root, tok = prompt_setup
    one, _ = fit_one_canned_step(root, tok, batch_size=2, accumulate=1, **options)
    two, _ = fit_one_canned_step(root, tok, batch_size=1, accumulate=2, **options)
    for key, value in one.items():
        torch.testing.assert_close(two[key], value, rtol=1e-5, atol=1e-6)
    start = make_grpo(root, tok, **options).model.state_dict()
    assert any(not torch.equal(start[k], v) for k, v in one.items())
