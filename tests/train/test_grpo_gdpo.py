"""Several rewards normalised apart (GDPO, TRL's ``multi_objective_aggregation:
normalize_then_sum``) and DAPO's soft overlong punishment, against TRL 1.16's own code."""

from __future__ import annotations

import pytest
import torch
from _rewards import length_mod3
from grpo_helpers import FakeResult, make_grpo, prompt_data
from trl.rewards import get_soft_overlong_punishment
from trl.trainer.utils import nanstd

from astrai.data.rewards import get_reward
from astrai.train.strategies.grpo import GRPOOptions
from astrai.train.strategies.grpo.advantages import aggregated_advantages, gdpo_advantages
from astrai.train.strategies.grpo.overlong import OverlongPenalty


def trl_normalize_then_sum(rewards_per_func, reward_weights, num_generations):
    """Transcribed from trl/trainer/grpo_trainer.py (TRL 1.16, ``_generate_and_score_
    completions``, the ``multi_objective_aggregation == "normalize_then_sum"`` branch; no
    unscorable rows)."""
    grouped = rewards_per_func.view(-1, num_generations, rewards_per_func.shape[1])
    mean_k = torch.nanmean(grouped, dim=1, keepdim=True)
    std_k = (
        nanstd(grouped, dim=1, keepdim=True) if num_generations > 1 else torch.zeros_like(mean_k)
    )
    reward_k = (grouped - mean_k) / (std_k + 1e-4)
    reward_k = reward_k.view(-1, rewards_per_func.shape[1])
    rewards = (reward_k * reward_weights.unsqueeze(0)).nansum(dim=1)
    std_rewards = (
        nanstd(rewards).expand_as(rewards) if rewards.numel() > 1 else torch.zeros_like(rewards)
    )
    advantages = (rewards - torch.nanmean(rewards)) / (std_rewards + 1e-4)
    return torch.nan_to_num(advantages, nan=0.0)


def test_gdpo_equals_trl_on_fixed_rewards():
    gen = torch.Generator().manual_seed(0)
    columns = torch.rand(12, 3, generator=gen).round(decimals=1)  # 3 groups of 4, 3 rewards
    columns[4:8, 0] = 1.0  # one reward with no variance in one group
    weights = torch.tensor([1.0, 0.5, 2.0])
    ours = gdpo_advantages(columns, weights, 4)
    theirs = trl_normalize_then_sum(columns, weights, 4)
    torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-6)
    # GDPO differs from normalising the weighted sum (the test can fail)
    by_name = {n: columns[:, i].tolist() for i, n in enumerate("abc")}
    summed = aggregated_advantages(
        columns @ weights, by_name, dict(zip("abc", weights.tolist())), 4
    )
    gdpo = aggregated_advantages(
        columns @ weights,
        by_name,
        dict(zip("abc", weights.tolist())),
        4,
        aggregation="normalize_then_sum",
    )
    torch.testing.assert_close(gdpo, theirs, rtol=0, atol=1e-6)
    assert not torch.allclose(summed, gdpo, atol=1e-3)


@pytest.mark.parametrize("cache", [1, 4, 20])
def test_overlong_penalty_equals_trl(cache):
    lengths = [0, 1, 10, 15, 16, 17, 19, 20, 21, 40]
    theirs = get_soft_overlong_punishment(max_completion_len=20, soft_punish_cache=cache)(
        [[7] * n for n in lengths]
    )
    ours = OverlongPenalty.parse({"len": cache}, 20).column(lengths)["overlong"]
    assert ours == pytest.approx(theirs, abs=1e-12)


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        ({"multi_objective_aggregation": "sum"}, "multi_objective_aggregation must be one of"),
        ({"reward_aggregation": "mean"}, "reward_aggregation must be one of"),
        (
            {"reward_aggregation": "sum", "multi_objective_aggregation": "normalize_then_sum"},
            "disagree",
        ),
        ({"reward_aggregation": "normalize_then_sum", "advantage": "rloo"}, "advantage=grpo"),
        (
            {"multi_objective_aggregation": "normalize_then_sum", "scale_rewards": "batch"},
            "scale_rewards=group",
        ),
        ({"overlong_penalty": {"len": 0}}, "overlong_penalty.len"),
        ({"overlong_penalty": {"len": 65}}, "at most max_new_tokens"),
        ({"overlong_penalty": {"len": 4, "factor": 1}}, r"unknown keys \['factor'\]"),
        ({"overlong_penalty": {"len": 4, "penalty_factor": -1}}, "penalty_factor"),
        (
            {
                "overlong_penalty": {"len": 4},
                "rewards": [
                    {"name": "overlong", "_target_": "_rewards.length_mod3", "_partial_": True}
                ],
            },
            "already named",
        ),
    ],
)
def test_bad_aggregation_and_overlong_settings_are_refused(kw, message):
    with pytest.raises((ValueError, KeyError), match=message):
        GRPOOptions.parse(**kw)


def test_the_issue_name_is_the_same_option():
    a = GRPOOptions.parse(reward_aggregation="normalize_then_sum")
    b = GRPOOptions.parse(multi_objective_aggregation="normalize_then_sum")
    assert a.multi_objective_aggregation == b.multi_objective_aggregation == "normalize_then_sum"
    assert GRPOOptions.parse(reward_aggregation="sum").multi_objective_aggregation == (
        "sum_then_normalize"
    )


@pytest.fixture(scope="module")
def prompt_setup(tmp_path_factory):
    return prompt_data(tmp_path_factory.mktemp("gdpo"))


@pytest.mark.parametrize("aggregation", ["sum_then_normalize", "normalize_then_sum"])
def test_a_grpo_step_uses_gdpo_and_the_overlong_column(prompt_setup, aggregation):
    root, tok = prompt_setup
    module = make_grpo(
        root,
        tok,
        max_new_tokens=6,
        rewards=[
            {"_target_": "_rewards.length_mod3", "_partial_": True, "weight": 1.0},
            {"name": "format", "weight": 0.5},
        ],
        multi_objective_aggregation=aggregation,
        overlong_penalty={"len": 3, "penalty_factor": 0.5},
    )
    prompts = [tok.encode("What is 2 + 3?"), tok.encode("What is 3 * 4?")]
    answer = tok.encode("The answer is 5.")
    completions = [answer[:n] for n in (1, 3, 4, 5, 6, 6, 2, 5)]

    def fake_generate(prompt_list, *, seed, params):
        return [FakeResult(c, [-1.0] * len(c)) for c in completions]

    module.live_source.generate = fake_generate
    records = [{"answer": "5"}, {"answer": "12"}]
    generation = module.rollout({"prompt_ids": prompts, "records": records})

    texts = [tok.decode(c, skip_special_tokens=True) for c in completions]
    fmt = get_reward("format")
    per = [records[i // 4] for i in range(8)]
    overlong = get_soft_overlong_punishment(max_completion_len=6, soft_punish_cache=3)(completions)
    columns = torch.tensor(
        [
            [length_mod3(r, t) for r, t in zip(per, texts)],
            [fmt(r, t) for r, t in zip(per, texts)],
            overlong,
        ]
    ).T
    weights = torch.tensor([1.0, 0.5, 0.5])
    assert any(v < 0 for v in overlong)  # the penalty bites on this batch
    if aggregation == "normalize_then_sum":
        expected = trl_normalize_then_sum(columns, weights, 4)
    else:  # TRL's sum_then_normalize with scale_rewards=group
        total = (columns * weights).sum(1).view(-1, 4)
        expected = (total - total.mean(1, keepdim=True)) / (total.std(1, keepdim=True) + 1e-4)
        expected = expected.flatten()
    torch.testing.assert_close(torch.tensor(generation.advantages), expected, rtol=0, atol=1e-5)
    assert generation.metrics["reward/overlong"] == pytest.approx(sum(overlong) / 8, abs=1e-6)


def test_reward_aggregation_reaches_the_options_through_the_module_kwargs():
    mine, rest = GRPOOptions.split({"reward_aggregation": "sum", "lr": 1.0})
    assert mine == {"reward_aggregation": "sum"} and rest == {"lr": 1.0}


@pytest.mark.slow  # a tiny GRPO run through python -m astrai.train (~30 s)
def test_a_tiny_run_with_gdpo_overlong_and_a_failing_reward(tmp_path, data_dir):
    from pathlib import Path

    from grpo_helpers import TINY_GRPO_CLI
    from train_helpers import cli, run_dirs

    from astrai.train.logs import read_metrics

    here = {"PYTHONPATH": str(Path(__file__).resolve().parent)}  # _rewards
    cli(
        [
            *TINY_GRPO_CLI,
            "data.batch_size=2",
            "trainer.max_steps=2",
            "trainer.log_every_n_steps=1",
            "strategy.reward_aggregation=normalize_then_sum",
            "strategy.overlong_penalty={len: 4, penalty_factor: 0.5}",
            "strategy.reward_workers=2",
            "strategy.rewards=[{_target_: _rewards.length_mod3, _partial_: true}, "
            "{_target_: _rewards.raises_on_even, _partial_: true, failure_value: -1, timeout: 5}]",
            *run_dirs(tmp_path, data_dir),
        ],
        env=here,
    )
    metrics = read_metrics(tmp_path / "run")
    for key in (
        "train/reward/overlong",
        "train/reward/raises_on_even",
        "train/reward/raises_on_even/failures",
        "train/reward/length_mod3/failures",
    ):
        assert key in metrics, (key, sorted(metrics))
    assert sum(v for _, v in metrics["train/reward/raises_on_even/failures"]) > 0
    assert all(v == 0 for _, v in metrics["train/reward/length_mod3/failures"])
