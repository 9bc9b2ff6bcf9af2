"""GRPO on multi-turn episodes (``strategy.environment``): only the model's tokens carry loss,
a failing environment costs its episode alone, and resume is exact (also asynchronous)."""

from __future__ import annotations

import dataclasses
import logging

import pytest
import torch
from grpo_helpers import make_grpo, prompt_data, prompt_module
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from train_helpers import quiet_trainer

from astrai.data.rewards import register_reward
from astrai.train.environments import Environment, StepResult

LENGTH_REWARD = "test_grpo_env_length"


@register_reward(LENGTH_REWARD)
def _length(record, completion):
    return float(len(completion) % 3)


class Checked(Environment):
    """Turn 1 hears "check it" (reward 0.25); turn 2 ends the episode. ``fail_on``: records
    whose prompt contains it raise in ``step``."""

    def __init__(self, fail_on: str | None = None) -> None:
        self.fail_on, self.turn = fail_on, 0

    def reset(self, record):
        self.prompt = record["prompt"]
        return [{"role": "user", "content": record["prompt"]}]

    def step(self, messages):
        self.turn += 1
        if self.fail_on is not None and self.fail_on in self.prompt:
            raise RuntimeError("the environment broke")
        if self.turn == 1:
            return StepResult([{"role": "user", "content": "check it"}], 0.25, False)
        return StepResult(None, 0.0, True)


KW = dict(rewards=[LENGTH_REWARD], loss_type="bnpo", kl_coef=0.0, environment=Checked, max_turns=3)


@pytest.fixture(scope="module")
def prompt_setup(tmp_path_factory):
    return prompt_data(tmp_path_factory.mktemp("grpo-env"))


class _Trace(Callback):
    def __init__(self) -> None:
        self.generations, self.losses, self.metrics = [], [], []

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
        self.generations.append(module.generation)
        self.losses.append(float(outputs["loss"]))
        self.metrics.append({k: float(v) for k, v in trainer.callback_metrics.items()})


def _fit(root, tok, steps, *, callbacks=(), ckpt_path=None, root_dir=None, **kw):
    module = make_grpo(root, tok, **{**KW, **kw})
    # a stop set that ends a random model's turns early, so that episodes have two turns
    stops = frozenset(range(0, len(tok), 5)) | frozenset(tok.stop_ids)
    module.live_source.params = dataclasses.replace(module.live_source.params, stop_ids=stops)
    trainer = quiet_trainer(
        default_root_dir=root_dir,
        max_steps=steps,
        callbacks=list(callbacks),
        enable_checkpointing=any(isinstance(c, ModelCheckpoint) for c in callbacks),
        limit_val_batches=0,
        use_distributed_sampler=False,
    )
    trainer.fit(module, datamodule=prompt_module(root), ckpt_path=ckpt_path)
    return {k: v.detach().clone() for k, v in module.model.state_dict().items()}, module


def test_only_the_models_tokens_carry_loss(prompt_setup):
    """The episodes' observation and template tokens are in the completions but not in the
    loss: at the first pass (ratio 1, bnpo, no KL) the loss is minus the advantages' mean
    over the model's tokens alone."""
    root, tok = prompt_setup
    trace = _Trace()
    _fit(root, tok, 2, callbacks=[trace])
    for generation, loss, metrics in zip(trace.generations, trace.losses, trace.metrics):
        masks = generation.action_masks
        assert masks is not None and all(1 in m for m in masks)
        assert sum(0 in m for m in masks) >= len(masks) // 2  # most episodes took two turns
        part = generation.slice(0, pad_id=0, device=torch.device("cpu"), mask_truncated=False)
        for row, mask in enumerate(masks):
            first = len(generation.prompts[row]) - 1
            got = part.loss_mask[row, first : first + len(mask)]
            assert got.tolist() == [float(m) for m in mask]
        adv = part.advantages.unsqueeze(-1)
        expected = -(adv * part.loss_mask).sum() / part.loss_mask.sum()
        assert loss == pytest.approx(expected.item(), abs=1e-6)
        assert 1.0 < metrics["train/episode/turns"] <= 2.0
        assert 0 < metrics["train/episode/masked_frac"] < 1


def test_a_failing_environment_fails_its_episode_alone(prompt_setup, caplog):
    root, tok = prompt_setup
    trace = _Trace()
    # the prompts are "What is a op b?": "+" fails some episodes, not all
    with caplog.at_level(logging.WARNING):
        _fit(root, tok, 2, callbacks=[trace], environment=lambda: Checked(fail_on="+"))
    errors = [m["train/episode/env_errors"] for m in trace.metrics]
    assert sum(errors) > 0
    assert "the environment broke" in caplog.text
    assert all(m["train/episode/turns"] > 0 for m in trace.metrics)


@pytest.mark.parametrize("options", [{}, {"async_rollouts": {"max_staleness": 1}}])
def test_multi_turn_resume_is_exact(prompt_setup, tmp_path, options):
    """mu 2 with a checkpoint after every step: resumed from step 1 (between the two passes
    over the first episodes), the run ends where the uninterrupted one does, bit for bit."""
    root, tok = prompt_setup
    kw = dict(num_iterations=2, **options)

    def fit(where, ckpt_path=None):
        ckpt = ModelCheckpoint(
            dirpath=where, filename="s{step}", every_n_train_steps=1, save_top_k=-1
        )
        return _fit(root, tok, 4, callbacks=[ckpt], ckpt_path=ckpt_path, root_dir=where, **kw)[0]

    final = fit(tmp_path / "a")
    (mid,) = (tmp_path / "a").glob("s*1.ckpt")
    saved = torch.load(mid, weights_only=False)
    assert saved["grpo_generation"]["action_masks"] is not None
    resumed = fit(tmp_path / "b", ckpt_path=mid)
    for key, value in final.items():
        assert torch.equal(resumed[key], value), key


@pytest.mark.parametrize(
    "spec, message",
    [
        ({"announce_tools": False}, "environment needs a _target_"),
        ({"_target_": "nowhere.Env"}, "GRPO environment 'nowhere.Env'"),
        ({"_target_": "builtins.dict"}, "has no reset"),
    ],
)
def test_bad_environments_are_named_before_the_model(spec, message):
    from astrai.train.strategies.grpo.sampling import environment_factory

    with pytest.raises(ValueError, match=message):
        environment_factory(spec)
