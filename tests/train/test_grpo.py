"""GRPO: advantages, k3 KL, clipped loss and rollout alignment against hand computations."""

from __future__ import annotations

import functools
import math

import pytest
import torch

from astrai.inference import InferenceEngine
from astrai.model import preset_model
from astrai.train.optim import adamw, constant
from astrai.train.strategies.grpo import (
    build_rollouts,
    group_advantages,
    grpo_loss,
    k3_kl,
    parse_rewards,
    score,
)


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


def _hand_loss(logp, old, adv, mask, ref, clip_eps, kl_coef):
    total, count, clipped_count = 0.0, 0, 0
    for i in range(len(logp)):
        for t in range(len(logp[i])):
            if not mask[i][t]:
                continue
            ratio = math.exp(logp[i][t] - old[i][t])
            a = adv[i]
            unclipped = ratio * a
            clipped = min(max(ratio, 1 - clip_eps), 1 + clip_eps) * a
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
        clip_eps=0.2,
        ref_logp=torch.tensor(ref),
        kl_coef=0.05,
    )
    assert loss.item() == pytest.approx(expected, rel=1e-6)
    assert metrics["clip_frac"].item() == pytest.approx(clip_frac)
    assert 0 < clip_frac < 1  # the fixed batch exercises both branches
    loss.backward()
    assert lp.grad[0, 2] == 0.0  # masked token: no gradient
    # On-policy (ratio 1, no KL): the gradient is -A / n_tokens per token.
    lp2 = torch.tensor(old, requires_grad=True)
    loss2, m2 = grpo_loss(lp2, torch.tensor(old), torch.tensor(adv), torch.tensor(mask))
    loss2.backward()
    assert lp2.grad[0, 0].item() == pytest.approx(-0.8 / 5)
    assert lp2.grad[1, 2].item() == pytest.approx(1.2 / 5)
    assert m2["clip_frac"].item() == 0.0
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
    """A tokenizer trained on the arithmetic chats and prepared prompt data."""
    from astrai.data.builtin import arithmetic_problems, sft_records
    from astrai.data.prepare import prepare
    from astrai.tokenizer import AutoTokenizer

    root = tmp_path_factory.mktemp("grpo")
    texts = [m["content"] for r in sft_records(arithmetic_problems(300)) for m in r["messages"]]
    tok = AutoTokenizer.train(texts * 2, vocab_size=320)
    tok.save_pretrained(root / "tok")
    prepare(
        "prompt",
        "builtin:arithmetic/prompt/train",
        root,
        root / "tok",
        name="prompts",
        required_fields=["answer"],
        builtin={"n": 32, "seed": 0},
        progress=False,
    )
    return root, tok


def _grpo(root, tok, **kw):
    from astrai.train.strategies.grpo import GRPOModule

    torch.manual_seed(0)
    args = dict(
        model=functools.partial(preset_model, "tiny", vocab_size=320),
        optimizer=functools.partial(adamw, lr=1e-3),
        scheduler=constant,
        tokenizer=str(root / "tok"),
        num_generations=4,
        max_new_tokens=6,
        rewards=[{"name": "exact_match", "weight": 1.0}, {"name": "format", "weight": 0.5}],
        kl_coef=0.1,
        clip_eps=0.2,
        engine=functools.partial(InferenceEngine, max_batch_size=16, max_seq_len=64),
    )
    args.update(kw)
    return GRPOModule(**args)


class _Result:
    def __init__(self, ids, lps):
        self.token_ids, self.logprobs, self.finish_reason, self.error = ids, lps, "stop", None


def test_grpo_compute_loss_matches_hand_computation(prompt_setup, monkeypatch):
    """Fixed completions and rollout log-probs (off-policy, so clipping is exercised): the
    module's loss equals advantages, ratios, k3 KL and the token mean computed by hand."""
    root, tok = prompt_setup
    module = _grpo(root, tok)
    with torch.no_grad():  # the policy drifts from the reference: KL > 0
        for p in module.model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    recs = [{"answer": "5"}, {"answer": "12"}]
    prompts = [tok.encode("What is 2 + 3?"), tok.encode("What is 3 * 4?")]
    texts = ["The answer is 5.", "The answer is 6.", "5", "x", "12", "The answer is 12.", "1", "2"]
    completions = [tok.encode(t) for t in texts]
    gen = torch.Generator().manual_seed(1)
    old = [(-3 * torch.rand(len(c), generator=gen)).tolist() for c in completions]

    def fake_generate(prompt_list, *, seed, **sampling):
        assert prompt_list == [p for p in prompts for _ in range(4)]
        return [_Result(c, lp) for c, lp in zip(completions, old)]

    monkeypatch.setattr(module, "_generate", fake_generate)
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
                kl = math.exp(rl - logp) - (rl - logp) - 1
                total += -surr + 0.1 * kl
                count += 1
    assert loss.item() == pytest.approx(total / count, rel=1e-4, abs=1e-5)
    assert metrics["reward_mean"].item() == pytest.approx(5.5 / 8)
    assert metrics["zero_var_frac"].item() == 0.0
    assert metrics["kl"].item() > 0
    assert 0 < metrics["clip_frac"].item() < 1


@pytest.mark.slow
def test_grpo_trains_under_lightning(prompt_setup, tmp_path):
    import lightning as L
    from lightning.pytorch.loggers import CSVLogger

    from astrai.data import AstraiDataModule, PromptDataset

    root, tok = prompt_setup
    module = _grpo(root, tok)
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
        "train/clip_frac",
        "train/gen_time_frac",
        "val/reward",
        "val/exact_match",
    ):
        assert key in logged, key
    assert 0 < float(logged["train/gen_time_frac"]) < 1
    assert module._engine is None  # shut down in teardown
    # the reference stayed, the policy moved
    assert all(torch.equal(a, b) for a, b in zip(ref_before, module.reference.model.parameters()))
    assert set(module.state_dict()) == {f"model.{k}" for k in module.model.state_dict()}


def test_grpo_engine_version_follows_optimizer_steps(prompt_setup):
    import unittest.mock as mock

    root, tok = prompt_setup
    module = _grpo(root, tok, kl_coef=0.0)
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
    assert module._engine is None


def test_grpo_rejects_bad_options(prompt_setup):
    root, tok = prompt_setup
    with pytest.raises(ValueError, match="num_generations"):
        _grpo(root, tok, num_generations=1)
    with pytest.raises(KeyError, match="available"):
        _grpo(root, tok, rewards=["nope"])
    with pytest.raises(ValueError, match="tokenizer"):
        _grpo(root, tok, tokenizer=None)


@pytest.mark.slow
def test_tiny_grpo_fast_via_entry_point(tmp_path, data_dir):
    import csv

    from train_helpers import cli, run_dirs

    cli(
        [
            "experiment=tiny_grpo",
            "debug=fast",
            "tokenizer.train.max_bytes=400000",  # shared with the other CLI tests' cache
            "data.train.prepare.builtin.n=32",
            "data.batch_size=2",
            "strategy.num_generations=4",
            "strategy.max_new_tokens=8",
            "callbacks.eval_generation.num_prompts=4",
            "callbacks.eval_generation.max_tokens=8",
            "callbacks.progress_bar=null",
            "trainer.enable_model_summary=false",
            *run_dirs(tmp_path, data_dir),
        ]
    )
    run = tmp_path / "run"
    assert (run / "export" / "model.safetensors").is_file()
    keys: set[str] = set()
    for f in run.glob("csv/**/metrics.csv"):
        with open(f) as fh:
            for row in csv.DictReader(fh):
                keys |= {k for k, v in row.items() if v}
    for key in (
        "train/loss",
        "train/reward_mean",
        "train/reward_std",
        "train/zero_var_frac",
        "train/kl",
        "train/clip_frac",
        "train/gen_time_frac",
        "eval/exact_match",
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
    """strategy.engine is the conf/engine/ factory with GRPO's sizes; grpo_1b selects paged."""
    from hydra.utils import instantiate

    from astrai.train.runner import compose

    cfg = compose(["strategy=grpo", "paths.output_dir=/tmp/unused"])
    factory = instantiate(cfg.strategy.engine)
    assert isinstance(factory, functools.partial) and factory.func is InferenceEngine
    kw = factory.keywords
    assert (kw["cache_mode"], kw["max_batch_size"], kw["max_seq_len"]) == ("contiguous", 64, 512)
    assert kw["page_size"] == 16  # the group's default, written once in conf/engine/
    tiny = compose(["experiment=tiny_grpo", "paths.output_dir=/tmp/unused"]).strategy.engine
    assert (tiny.cache_mode, tiny.max_batch_size, tiny.max_seq_len) == ("contiguous", 64, 128)
    big = compose(["experiment=grpo_1b", "paths.output_dir=/tmp/unused"]).strategy.engine
    assert (big.cache_mode, big.max_seq_len, big.kv_tokens, big.page_size) == (
        "paged",
        2048,
        262144,
        16,
    )
