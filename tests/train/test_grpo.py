"""GRPO: advantages, k3 KL, clipped loss and rollout alignment against hand computations."""

from __future__ import annotations

import functools
import math

import pytest
import torch
from grpo_helpers import FakeResult, fit_one_canned_step, make_grpo, prompt_data
from train_helpers import quiet_trainer

from astrai.data.rewards import register_reward
from astrai.inference import InferenceEngine
from astrai.model import preset_model
from astrai.train.strategies.grpo import build_rollouts, parse_rewards, score
from astrai.train.strategies.grpo.advantages import group_advantages
from astrai.train.strategies.grpo.loss import grpo_loss, k3_kl


def test_group_advantages_by_hand():
    rewards = torch.tensor([[1.0, 0.0, 0.0, 1.0], [1.0, 1.0, 1.0, 1.0], [2.0, 0.0, 1.0, 1.0]])
    adv = group_advantages(rewards, eps=0.0)
    std0 = math.sqrt(((0.5**2) * 4) / 3)  # unbiased
    assert adv[0].tolist() == pytest.approx([0.5 / std0, -0.5 / std0, -0.5 / std0, 0.5 / std0])
    assert torch.isnan(adv[1]).all()  # eps=0 and zero variance: 0/0
    adv = group_advantages(rewards, eps=1e-4)
    assert adv[1].tolist() == [0.0, 0.0, 0.0, 0.0]  # zero-variance group: no gradient
    std2 = math.sqrt((1.0 + 1.0 + 0.0 + 0.0) / 3)
    assert adv[2].tolist() == pytest.approx([1 / (std2 + 1e-4), -1 / (std2 + 1e-4), 0.0, 0.0])
    with pytest.raises(ValueError):
        group_advantages(torch.ones(4))
    with pytest.raises(ValueError):
        group_advantages(torch.ones(4, 1))


def test_k3_kl_by_hand():
    logp = torch.tensor([-1.0, -2.0, -0.5])
    ref = torch.tensor([-1.0, -1.5, -0.7])
    expected = [math.exp(r - p) - (r - p) - 1 for p, r in zip(logp.tolist(), ref.tolist())]
    assert k3_kl(logp, ref).tolist() == pytest.approx(expected)
    assert k3_kl(logp, ref)[0] == 0.0
    assert (k3_kl(logp, ref) >= 0).all()


def _hand_loss(logp, old, adv, mask, ref, epsilon, kl_coef):
    """Token mean (bnpo) of the clipped objective plus k3 KL, and the clipped share."""
    total, count, clipped_count = 0.0, 0, 0
    for i in range(len(logp)):
        for t in range(len(logp[i])):
            if not mask[i][t]:
                continue
            ratio = math.exp(logp[i][t] - old[i][t])
            a = adv[i]
            unclipped = ratio * a
            clipped = min(max(ratio, 1 - epsilon), 1 + epsilon) * a
            d = ref[i][t] - logp[i][t]
            kl = math.exp(d) - d - 1
            total += -min(unclipped, clipped) + kl_coef * kl
            clipped_count += clipped < unclipped
            count += 1
    return total / count, clipped_count / count


def test_grpo_loss_matches_hand_computation():
    logp = [[-1.0, -0.2, -3.0], [-0.5, -0.9, -1.1]]
    old = [[-1.3, -0.2, -2.0], [-0.1, -1.0, -1.1]]
    ref = [[-1.1, -0.4, -2.5], [-0.6, -0.9, -1.0]]
    mask = [[1, 1, 0], [1, 1, 1]]
    adv = [0.8, -1.2]
    expected, clip_frac = _hand_loss(logp, old, adv, mask, ref, 0.2, 0.05)
    lp = torch.tensor(logp, requires_grad=True)
    loss, metrics = grpo_loss(
        lp,
        torch.tensor(old),
        torch.tensor(adv),
        torch.tensor(mask),
        loss_type="bnpo",
        epsilon=0.2,
        ref_logp=torch.tensor(ref),
        kl_coef=0.05,
    )
    assert loss.item() == pytest.approx(expected, rel=1e-6)
    assert metrics["clip_ratio/region_mean"].item() == pytest.approx(clip_frac)
    assert 0 < clip_frac < 1  # the fixed batch exercises both branches
    loss.backward()
    assert lp.grad[0, 2] == 0.0  # masked token: no gradient
    # On-policy (ratio 1, no KL): the gradient is -A / n_tokens per token.
    lp2 = torch.tensor(old, requires_grad=True)
    loss2, m2 = grpo_loss(
        lp2, torch.tensor(old), torch.tensor(adv), torch.tensor(mask), loss_type="bnpo"
    )
    loss2.backward()
    assert lp2.grad[0, 0].item() == pytest.approx(-0.8 / 5)
    assert lp2.grad[1, 2].item() == pytest.approx(1.2 / 5)
    assert m2["clip_ratio/region_mean"].item() == 0.0
    with pytest.raises(ValueError):
        grpo_loss(lp2, lp2, torch.tensor(adv), torch.tensor(mask), kl_coef=0.1)


def test_build_rollouts_aligns_logprobs_with_targets():
    prompts = [[5, 6, 7], [8]]
    completions = [[9, 2], [3, 4, 1]]
    logprobs = [[-0.1, -0.2], [-0.3, -0.4, -0.5]]
    r = build_rollouts(prompts, completions, logprobs, pad_id=0)
    assert r.input_ids.tolist() == [[5, 6, 7, 9, 2], [8, 3, 4, 1, 0]]
    assert r.mask.tolist() == [[0, 0, 1, 1], [1, 1, 1, 0]]
    expected = torch.tensor([[0, 0, -0.1, -0.2], [-0.3, -0.4, -0.5, 0]])
    torch.testing.assert_close(r.old_logp, expected)
    assert r.completion_lengths.tolist() == [2, 3]
    # target t of row 0 is input_ids[0, t+1]: the completion tokens sit under the mask
    targets = r.input_ids[:, 1:]
    assert targets[r.mask.bool()].tolist() == [9, 2, 3, 4, 1]
    with pytest.raises(ValueError):
        build_rollouts([[1]], [[2, 3]], [[-0.1]])


def test_rewards_config_and_scoring():
    assert parse_rewards("exact_match") == [("exact_match", 1.0)]
    assert parse_rewards([{"name": "exact_match"}, {"name": "format", "weight": 0.5}]) == [
        ("exact_match", 1.0),
        ("format", 0.5),
    ]
    assert parse_rewards({"format": 0.1}) == [("format", 0.1)]
    with pytest.raises(KeyError, match="available"):
        parse_rewards(["no_such_reward"])
    records = [{"answer": "5"}, {"answer": "5"}]
    texts = ["2 + 3 = 5. The answer is 5.", "The answer is 6"]
    total, parts = score(records, texts, [("exact_match", 1.0), ("format", 0.5)])
    assert total.tolist() == [1.5, 0.5]
    assert parts["exact_match"].item() == 0.5


# ------------------------------------------------------------------ GRPOModule


@pytest.fixture(scope="module")
def prompt_setup(tmp_path_factory):
    return prompt_data(tmp_path_factory.mktemp("grpo"))


def test_grpo_compute_loss_matches_hand_computation(prompt_setup, monkeypatch):
    """Fixed completions and rollout log-probs (off-policy, so clipping is exercised): the
    module's loss equals advantages, ratios, k3 KL and the token mean computed by hand."""
    root, tok = prompt_setup
    module = make_grpo(root, tok)
    with torch.no_grad():  # the policy drifts from the reference: KL > 0
        for p in module.model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    recs = [{"answer": "5"}, {"answer": "12"}]
    prompts = [tok.encode("What is 2 + 3?"), tok.encode("What is 3 * 4?")]
    texts = ["The answer is 5.", "The answer is 6.", "5", "x", "12", "The answer is 12.", "1", "2"]
    completions = [tok.encode(t) for t in texts]
    gen = torch.Generator().manual_seed(1)
    old = [(-3 * torch.rand(len(c), generator=gen)).tolist() for c in completions]

    def fake_generate(prompt_list, *, seed, params):
        assert prompt_list == prompts and params.n == 4  # one group of 4 per prompt
        return [FakeResult(c, lp) for c, lp in zip(completions, old)]

    monkeypatch.setattr(module.live_source, "generate", fake_generate)
    loss, metrics = module.compute_loss({"prompt_ids": prompts, "records": recs})

    # by hand
    rewards = [[1.5, 0.5, 1.0, 0.0], [1.0, 1.5, 0.0, 0.0]]  # exact_match + 0.5 * format
    adv = []
    for g in rewards:
        mean = sum(g) / 4
        std = math.sqrt(sum((x - mean) ** 2 for x in g) / 3)
        adv += [(x - mean) / (std + 1e-4) for x in g]
    total, count = 0.0, 0
    ref = module.reference.model
    with torch.no_grad():
        for i, (c, lp) in enumerate(zip(completions, old)):
            seq = torch.tensor([prompts[i // 4] + c])
            pol = torch.log_softmax(module.model(seq)[0], -1)
            rlp = torch.log_softmax(ref(seq)[0], -1)
            for k, tokid in enumerate(c):
                t = len(prompts[i // 4]) - 1 + k  # position predicting completion token k
                logp, rl = pol[t, tokid].item(), rlp[t, tokid].item()
                ratio = math.exp(logp - lp[k])
                surr = min(ratio * adv[i], min(max(ratio, 0.8), 1.2) * adv[i])
                kl = (math.exp(rl - logp) - (rl - logp) - 1) * ratio  # bias-corrected (TRL)
                total += -surr + 0.1 * kl
                count += 1
    assert loss.item() == pytest.approx(total / count, rel=1e-4, abs=1e-5)
    assert metrics["reward_mean"].item() == pytest.approx(5.5 / 8)
    assert metrics["zero_var_frac"].item() == 0.0
    assert metrics["kl"].item() > 0
    assert 0 < metrics["clip_ratio/region_mean"].item() < 1


@pytest.mark.slow
def test_grpo_trains_under_lightning(prompt_setup, tmp_path):
    import lightning as L
    from lightning.pytorch.loggers import CSVLogger

    from astrai.data import AstraiDataModule, PromptDataset

    root, tok = prompt_setup
    module = make_grpo(root, tok)
    dm = AstraiDataModule(
        train=PromptDataset(str(root / "prompts.h5")),
        val=PromptDataset(str(root / "prompts.h5")),
        batch_size=2,
        val_batch_size=4,
        seed=0,
    )
    trainer = L.Trainer(
        default_root_dir=tmp_path,
        max_steps=3,
        accelerator="cpu",
        logger=CSVLogger(tmp_path),
        log_every_n_steps=1,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=1,
        val_check_interval=3,
        check_val_every_n_epoch=None,
        use_distributed_sampler=False,
    )
    ref_before = [p.clone() for p in module.reference.model.parameters()]
    trainer.fit(module, datamodule=dm)
    logged = trainer.logged_metrics
    for key in (
        "train/loss",
        "train/reward_mean",
        "train/reward_std",
        "train/zero_var_frac",
        "train/kl",
        "train/clip_ratio/region_mean",
        "train/gen_time_frac",
        "val/reward",
        "val/exact_match",
    ):
        assert key in logged, key
    assert 0 < float(logged["train/gen_time_frac"]) < 1
    assert not module.policy_engine.built  # shut down in teardown
    # the reference stayed, the policy moved
    assert all(torch.equal(a, b) for a, b in zip(ref_before, module.reference.model.parameters()))
    assert set(module.state_dict()) == {f"model.{k}" for k in module.model.state_dict()}


def test_grpo_engine_version_follows_optimizer_steps(prompt_setup):
    import unittest.mock as mock

    root, tok = prompt_setup
    module = make_grpo(root, tok, kl_coef=0.0)
    assert module.reference is None  # kl_coef 0: no reference model
    engine = module.engine
    assert engine.model is module.model  # live weights, no copy
    assert engine.max_seq_len == 64  # the factory's sizes (conf: strategy.engine)
    assert engine.policy_version == 0
    # Lightning after 3 optimizer steps: the engine's policy version follows.
    with mock.patch.object(type(module), "global_step", new_callable=mock.PropertyMock) as gs:
        gs.return_value = 3
        module.on_train_batch_end(None, None, 0)
    assert engine.scheduler.policy_version == 3
    module.teardown("fit")
    assert not module.policy_engine.built


def test_grpo_rejects_bad_options(prompt_setup):
    root, tok = prompt_setup
    with pytest.raises(ValueError, match="num_generations"):
        make_grpo(root, tok, num_generations=1)
    with pytest.raises(KeyError, match="available"):
        make_grpo(root, tok, rewards=["nope"])
    with pytest.raises(ValueError, match="tokenizer"):
        make_grpo(root, tok, tokenizer=None)


@pytest.mark.parametrize(("option", "value"), [("top_p", 1.5), ("top_k", -2)])
def test_a_bad_rollout_setting_fails_before_the_model_is_built(prompt_setup, option, value):
    root, tok = prompt_setup

    def model(*args, **kwargs):
        pytest.fail("the model was built before the rollout settings were checked")

    with pytest.raises(ValueError, match=f"^GRPO rollout sampling: {option} must be"):
        make_grpo(root, tok, model=model, **{option: value})


@pytest.mark.slow
def test_tiny_grpo_fast_via_entry_point(tmp_path, data_dir):
    from train_helpers import cli, run_dirs

    from astrai.train.logs import read_metrics

    cli(
        [
            "experiment=tiny_grpo",
            "debug=fast",
            "tokenizer.train.max_bytes=400000",  # shared with the other CLI tests' cache
            "data.train.prepare.builtin.n=32",
            "data.batch_size=2",
            "strategy.num_generations=4",
            "strategy.max_new_tokens=8",
            "strategy.kl_coef=0.04",  # a reference model and train/kl whatever the recipe says
            "strategy.init_from=null",  # no tiny_sft_start export here: an explicit fresh start
            "callbacks.eval.suites.arithmetic.num_prompts=4",
            "callbacks.eval.suites.arithmetic.max_tokens=8",
            "callbacks.progress_bar=null",
            "trainer.enable_model_summary=false",
            *run_dirs(tmp_path, data_dir),
        ]
    )
    run = tmp_path / "run"
    assert (run / "export" / "model.safetensors").is_file()
    keys = set(read_metrics(run))
    for key in (
        "train/loss",
        "train/reward_mean",
        "train/reward_std",
        "train/zero_var_frac",
        "train/kl",
        "train/clip_ratio/region_mean",
        "train/gen_time_frac",
        "eval/arithmetic/exact_match",
    ):
        assert key in keys, key


def test_closeness_reward():
    from astrai.data.rewards import get_reward

    fn = get_reward("closeness")  # registered by astrai.data.rewards itself
    assert fn({"answer": "12"}, "The answer is 12.") == 1.0
    assert fn({"answer": "12"}, "3 * 4 = 12. The answer is 10.") == pytest.approx(1 / 3)
    assert fn({"answer": "-5"}, "no number here") == 0.0
    with pytest.raises(KeyError):
        fn({}, "The answer is 1.")


def test_grpo_engine_comes_from_the_engine_group():
    """strategy.engine is the conf/engine/ factory with GRPO's sizes, paged (a prompt's G
    samples share its pages); grpo_1b sizes its KV budget."""
    from hydra.utils import instantiate

    from astrai.train.runner import compose

    cfg = compose(["strategy=grpo", "paths.output_dir=/tmp/unused"])
    factory = instantiate(cfg.strategy.engine)
    assert isinstance(factory, functools.partial) and factory.func is InferenceEngine
    kw = factory.keywords
    assert (kw["cache_mode"], kw["max_batch_size"], kw["max_seq_len"]) == ("paged", 64, 512)
    assert kw["page_size"] == 16  # the group's default, written once in conf/engine/
    tiny = compose(["experiment=tiny_grpo", "paths.output_dir=/tmp/unused"]).strategy.engine
    assert (tiny.cache_mode, tiny.max_seq_len) == ("paged", 128)  # the recipe's sizes
    big = compose(["experiment=grpo_1b", "paths.output_dir=/tmp/unused"]).strategy.engine
    assert (big.cache_mode, big.max_seq_len, big.kv_tokens, big.page_size) == (
        "paged",
        2048,
        262144,
        16,
    )


# ------------------------------------------------------------------ loss types, sync, options

PARITY_REWARD = "test_grpo_parity"


@register_reward(PARITY_REWARD)
def _parity(record, completion):
    """Varies for a random policy (so advantages are not all zero and the policy moves)."""
    return float(len(completion) % 2)


def test_dapo_under_gradient_accumulation_equals_one_batch(prompt_setup):
    """Two micro-batches of 1 prompt (their completion-token counts differ) give the same
    SGD step as one batch of 2 prompts: dapo normalises by the window's token count, like
    TRL's num_items_in_batch. bnpo (a mean per micro-batch) does not, as in TRL."""
    root, tok = prompt_setup
    steps = {}
    for loss_type in ("dapo", "bnpo"):
        for bs, acc in ((2, 1), (1, 2)):
            steps[loss_type, acc], prompts = fit_one_canned_step(
                root, tok, loss_type=loss_type, batch_size=bs, accumulate=acc
            )
            assert len(prompts) == 2
    for key, value in steps["dapo", 1].items():
        torch.testing.assert_close(steps["dapo", 2][key], value, rtol=1e-5, atol=1e-6)
    moved = max((steps["dapo", 1][k] - steps["bnpo", 1][k]).abs().max() for k in steps["dapo", 1])
    assert moved < 1e-5  # one batch on one process: dapo is bnpo
    assert any(
        not torch.allclose(steps["bnpo", 2][k], v, rtol=1e-5, atol=1e-6)
        for k, v in steps["bnpo", 1].items()
    )


def test_training_logprobs_use_the_sampling_temperature(prompt_setup):
    """Real engine rollouts at temperature 0.7: the training forward (logits / 0.7) gives the
    rollout's own log-probs back, so the ratio is 1 and nothing is clipped."""
    root, tok = prompt_setup
    module = make_grpo(root, tok, temperature=0.7, kl_coef=0.0)
    prompts = [tok.encode("What is 2 + 3?"), tok.encode("What is 3 * 4?")]
    _, metrics = module.compute_loss({"prompt_ids": prompts, "records": [{"answer": "5"}] * 2})
    assert metrics["ratio"].item() == pytest.approx(1.0, abs=1e-5)
    assert metrics["clip_ratio/region_mean"].item() == 0.0
    module.teardown("fit")


def _fit_resumable(root, tok, tmp_path, *, ckpt_path=None):
    """Four GRPO steps with a moving reference; a checkpoint is written after step 3."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    from astrai.data import AstraiDataModule, PromptDataset

    module = make_grpo(
        root, tok, sync_interval=2, sync_alpha=0.5, kl_coef=0.5, rewards=[PARITY_REWARD]
    )
    dm = AstraiDataModule(train=PromptDataset(str(root / "prompts.h5")), batch_size=2, seed=0)
    ckpt = ModelCheckpoint(
        dirpath=tmp_path, filename="step{step}", every_n_train_steps=3, save_top_k=-1
    )
    trainer = quiet_trainer(
        default_root_dir=tmp_path,
        max_steps=4,
        callbacks=[ckpt],
        enable_checkpointing=True,
        limit_val_batches=0,
        use_distributed_sampler=False,
    )
    trainer.fit(module, datamodule=dm, ckpt_path=ckpt_path)
    ref = {k: v.clone() for k, v in module.reference.model.state_dict().items()}
    return module.model.state_dict(), ref


def test_reference_sync_every_interval_and_exact_resume(prompt_setup, tmp_path):
    """sync_interval 2, alpha 0.5: the reference moves half-way to the policy after step 2
    (and 4). A run resumed from its step-3 checkpoint ends with the same policy and
    reference as the uninterrupted one, because the checkpoint carries the synced reference;
    without it the resumed step's KL term differs."""
    root, tok = prompt_setup
    initial = make_grpo(root, tok).model.state_dict()
    policy4, ref4 = _fit_resumable(root, tok, tmp_path / "a")
    key = next(k for k, v in ref4.items() if v.dim() == 2)
    assert not torch.equal(ref4[key], initial[key])  # the reference moved
    (ckpt,) = (tmp_path / "a").glob("step*3*.ckpt")
    saved = torch.load(ckpt, weights_only=True)
    assert not torch.equal(saved["grpo_reference"]["state_dict"][key], initial[key])
    policy_r, ref_r = _fit_resumable(root, tok, tmp_path / "b", ckpt_path=ckpt)
    for k, v in policy4.items():
        torch.testing.assert_close(policy_r[k], v, rtol=0, atol=0)
    for k, v in ref4.items():
        torch.testing.assert_close(ref_r[k], v, rtol=0, atol=0)
    # the same checkpoint without the reference: the last step sees the initial reference
    del saved["grpo_reference"]
    stripped = tmp_path / "stripped.ckpt"
    torch.save(saved, stripped)
    policy_s, _ = _fit_resumable(root, tok, tmp_path / "c", ckpt_path=stripped)
    assert any(not torch.equal(policy_s[k], v) for k, v in policy4.items())


def test_sync_reference_mixes_and_copies():
    from astrai.train.strategies.grpo.reference import sync_reference

    torch.manual_seed(0)
    policy = preset_model("tiny", vocab_size=320)
    ref = preset_model("tiny", vocab_size=320)
    before = {k: v.clone() for k, v in ref.state_dict().items()}
    sync_reference(ref, policy, alpha=0.25)
    for k, v in policy.state_dict().items():
        torch.testing.assert_close(ref.state_dict()[k], 0.25 * v + 0.75 * before[k])
    sync_reference(ref, policy)
    assert all(torch.equal(ref.state_dict()[k], v) for k, v in policy.state_dict().items())


def test_grpo_rejects_bad_loss_options(prompt_setup):
    root, tok = prompt_setup
    with pytest.raises(ValueError, match="clip_eps was renamed epsilon"):
        make_grpo(root, tok, clip_eps=0.2)
    with pytest.raises(ValueError, match="loss_type"):
        make_grpo(root, tok, loss_type="ppo")
    with pytest.raises(ValueError, match="epsilon_high"):
        make_grpo(root, tok, epsilon_high=-0.1)
    with pytest.raises(ValueError, match="temperature"):
        make_grpo(root, tok, temperature=0.0)
    with pytest.raises(ValueError, match="sync_interval"):
        make_grpo(root, tok, sync_interval=2, kl_coef=0.0)
    with pytest.raises(ValueError, match="sync_alpha"):
        make_grpo(root, tok, sync_interval=2, sync_alpha=0.0)
    with pytest.raises(ValueError, match="dr_grpo needs max_completion_length"):
        grpo_loss(
            torch.zeros(1, 2),
            torch.zeros(1, 2),
            torch.ones(1),
            torch.ones(1, 2),
            loss_type="dr_grpo",
        )
