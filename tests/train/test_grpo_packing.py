"""GRPO padding-free micro-batches (packed rows, restarting positions) and by token budget
(verl's use_dynamic_bsz / ppo_max_token_len_per_gpu) give the loss and every gradient of the
right-padded layout (fp32, 1e-6), for every loss_type; bad settings are refused by key."""

from __future__ import annotations

import pytest
import torch
from grpo_helpers import FakeResult, make_grpo, prompt_data

from astrai.train.strategies.grpo.packing import (
    PackedRows,
    PaddedRows,
    RowPacking,
    spread_groups,
    token_groups,
)

TEXTS = [
    "The answer is 5.",
    "5",
    "The answer is 6, or maybe 7.",
    "x",
    "12",
    "The answer is 12.",
    "1",
    "I think it is 2 but not sure",
]


@pytest.fixture(scope="module")
def prompt_setup(tmp_path_factory):
    return prompt_data(tmp_path_factory.mktemp("grpo-packing"))


def _loss_and_grads(root, tok, *, num_iterations=1, **options):
    """One micro-step on fixed completions (off-policy log-probs, a drifted policy): the
    loss, the metrics and every parameter's gradient."""
    module = make_grpo(root, tok, max_new_tokens=30, num_iterations=num_iterations, **options)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():  # the policy drifts from the reference: KL > 0, ratios != 1
        for p in module.model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g))
    prompts = [tok.encode("What is 2 + 3?"), tok.encode("What is 3 * 4, if you please?")]
    completions = [tok.encode(t) for t in TEXTS]
    old = [(-3 * torch.rand(len(c), generator=g)).tolist() for c in completions]
    finish = ["stop", "stop", "length", "stop", "stop", "length", "stop", "stop"]

    def fake_generate(prompt_list, *, seed, params):
        return [FakeResult(c, lp, f) for c, lp, f in zip(completions, old, finish)]

    module.live_source.generate = fake_generate
    batch = {"prompt_ids": prompts, "records": [{"answer": "5"}, {"answer": "12"}]}
    out = []
    for _ in range(num_iterations):  # later iterations read the cached reference log-probs
        module.zero_grad()
        loss, metrics = module.compute_loss(batch)
        loss.backward()
        grads = {
            n: p.grad.clone() for n, p in module.model.named_parameters() if p.grad is not None
        }
        out.append((loss.detach(), metrics, grads, module.generation))
    return out


def _assert_same(padded, packed):
    for (loss_a, metrics_a, grads_a, _), (loss_b, metrics_b, grads_b, _) in zip(padded, packed):
        torch.testing.assert_close(loss_b, loss_a, atol=1e-6, rtol=0)
        for key in ("kl", "ratio", "clip_ratio/region_mean", "entropy"):
            torch.testing.assert_close(metrics_b[key], metrics_a[key], atol=1e-6, rtol=0)
        assert grads_a.keys() == grads_b.keys() and grads_a
        for name, grad in grads_a.items():
            torch.testing.assert_close(grads_b[name], grad, atol=1e-6, rtol=0, msg=name)


@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dr_grpo", "dapo"])
def test_padding_free_micro_batches_equal_padded_ones(prompt_setup, loss_type):
    root, tok = prompt_setup
    padded = _loss_and_grads(root, tok, loss_type=loss_type)
    packed = _loss_and_grads(root, tok, loss_type=loss_type, padding_free=True)
    # a budget of ~3 sequences: several packed rows, each recomputed in the backward
    budget = _loss_and_grads(
        root,
        tok,
        loss_type=loss_type,
        padding_free=True,
        use_dynamic_bsz=True,
        ppo_max_token_len_per_gpu=60,
    )
    part = budget[0][3].slice(
        0,
        pad_id=0,
        device=torch.device("cpu"),
        mask_truncated=False,
        packing=RowPacking(True, True, 60),
    )
    assert len(part.rollouts.rows.groups) == 4  # 8 sequences of 9 to 49 tokens
    _assert_same(padded, packed)
    _assert_same(padded, budget)


def test_packed_layout_follows_per_token_options(prompt_setup):
    """Per-token advantages (REINFORCE++), sequence-level ratios (GSPO), masked truncated
    completions and the reference cache over two iterations. (Not the entropy mask: its
    quantile threshold is discontinuous, and a random tiny model's entropies cluster within
    1e-6 of it, where float rounding of either layout flips tokens.)"""
    root, tok = prompt_setup
    options = dict(
        loss_type="bnpo",
        advantage="reinforce_pp",
        importance_sampling_level="sequence",
        mask_truncated_completions=True,
        num_iterations=2,
    )
    padded = _loss_and_grads(root, tok, **options)
    packed = _loss_and_grads(
        root, tok, padding_free=True, use_dynamic_bsz=True, ppo_max_token_len_per_gpu=50, **options
    )
    assert packed[0][3].ref_logp  # the reference log-probs were kept for iteration 2
    _assert_same(padded, packed)


def test_token_groups_fill_the_budget_in_order():
    assert token_groups([5, 4, 3, 9, 1], 9) == [(0, 2), (2, 3), (3, 4), (4, 5)]
    assert token_groups([5, 4, 3], 100) == [(0, 3)]
    with pytest.raises(ValueError, match="ppo_max_token_len_per_gpu=8"):
        token_groups([5, 9], 8)
    layout = RowPacking(True, True, 9).layout([5, 4, 3], 5)
    assert isinstance(layout, PackedRows) and layout.groups == [(0, 2), (2, 3)]
    assert isinstance(RowPacking().layout([5, 4], 5), PaddedRows)


def test_every_rank_runs_as_many_forwards_as_the_busiest():
    # under FSDP2 each forward is a collective: a rank whose rollouts pack into fewer rows
    # splits its largest group until it runs the other ranks' count (verl equalises too)
    assert spread_groups([(0, 2), (2, 3)], 2) == [(0, 2), (2, 3)]
    assert spread_groups([(0, 4), (4, 5)], 4) == [(0, 1), (1, 2), (2, 4), (4, 5)]
    with pytest.raises(RuntimeError, match="use_dynamic_bsz: 4 forwards"):
        spread_groups([(0, 2), (2, 3)], 4)
    lengths = [3, 2, 2, 2]
    groups = RowPacking(True, True, 9, agree=lambda n: 3).layout(lengths, 3).groups
    assert len(groups) == 3 and [g for a, b in groups for g in range(a, b)] == [0, 1, 2, 3]
    assert all(sum(lengths[a:b]) <= 9 for a, b in groups)


def test_more_forwards_give_the_same_loss_and_gradients(prompt_setup, monkeypatch):
    """The forwards a rank adds to match the others change nothing but the batching."""
    root, tok = prompt_setup
    options = dict(padding_free=True, use_dynamic_bsz=True, ppo_max_token_len_per_gpu=60)
    alone = _loss_and_grads(root, tok, **options)
    monkeypatch.setattr(
        "astrai.train.strategies.grpo.module.max_over_ranks", lambda trainer: lambda n: n + 3
    )
    matched = _loss_and_grads(root, tok, **options)
    _assert_same(alone, matched)


@pytest.mark.parametrize(
    ("options", "key"),
    [
        (dict(padding_free="yes"), "padding_free"),
        (dict(use_dynamic_bsz=1), "use_dynamic_bsz"),
        (dict(use_dynamic_bsz=True), "use_dynamic_bsz"),  # without padding_free
        (dict(ppo_max_token_len_per_gpu=0), "ppo_max_token_len_per_gpu"),
        (dict(ppo_max_token_len_per_gpu=2.5), "ppo_max_token_len_per_gpu"),
        (
            dict(padding_free=True, use_dynamic_bsz=True, ppo_max_token_len_per_gpu=30),
            "ppo_max_token_len_per_gpu",
        ),
    ],
)
def test_bad_packing_settings_are_refused_before_the_model_is_built(prompt_setup, options, key):
    root, tok = prompt_setup

    def model(*args, **kwargs):
        pytest.fail("the model was built before the packing settings were checked")

    with pytest.raises(ValueError, match=f"^GRPO {key}"):
        make_grpo(root, tok, model=model, max_new_tokens=30, **options)


def _fit(root, tok, **options):
    """Two optimizer steps under Lightning (2 accumulated micro-steps each, one generation
    batch of 2 prompts split into 2 slices and trained on twice): the final weights."""
    from train_helpers import quiet_trainer

    from astrai.data import AstraiDataModule, PromptDataset

    module = make_grpo(
        root,
        tok,
        max_new_tokens=30,
        steps_per_generation=2,
        num_iterations=2,
        optimizer=lambda m: torch.optim.SGD(m.parameters(), lr=1.0),
        **options,
    )

    def fake_generate(prompt_list, *, seed, params):
        g = torch.Generator().manual_seed(seed)
        out = []
        for _ in prompt_list:
            for i in torch.randint(0, len(TEXTS), (params.n,), generator=g).tolist():
                ids = tok.encode(TEXTS[i])
                out.append(FakeResult(ids, (-2 * torch.rand(len(ids), generator=g)).tolist()))
        return out

    module.live_source.generate = fake_generate
    start = {k: v.clone() for k, v in module.model.state_dict().items()}
    dm = AstraiDataModule(train=PromptDataset(str(root / "prompts.h5")), batch_size=1, seed=0)
    trainer = quiet_trainer(
        max_steps=2, accumulate_grad_batches=2, limit_val_batches=0, use_distributed_sampler=False
    )
    trainer.fit(module, datamodule=dm)
    end = module.model.state_dict()
    assert max((end[k] - v).abs().max() for k, v in start.items()) > 1e-3  # it trained
    return {k: v.clone() for k, v in end.items()}


@pytest.mark.parametrize("loss_type", ["dapo", "grpo"])
def test_padding_free_training_under_lightning_equals_padded(prompt_setup, loss_type):
    """Accumulation, the dapo count over the optimizer step and the reference cache under a
    trainer: the weights after two SGD steps are the padded run's."""
    root, tok = prompt_setup
    padded = _fit(root, tok, loss_type=loss_type)
    packed = _fit(
        root,
        tok,
        loss_type=loss_type,
        padding_free=True,
        use_dynamic_bsz=True,
        ppo_max_token_len_per_gpu=80,
    )
    for name, value in padded.items():
        torch.testing.assert_close(packed[name], value, atol=1e-6, rtol=0, msg=name)
