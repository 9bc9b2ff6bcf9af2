"""strategy=ppo (``astrai.train.strategies.ppo``): the policy loss is GRPO's, the critic's
value loss is added, its options are refused before a model is built, a short run trains the
critic alone during its warm-up and then both, resumes from any checkpoint bit for bit (the
critic and the generation batch's values and returns included), and the critic exports as a
token-classification directory that loads back."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import pytest
import torch
from grpo_helpers import make_grpo, prompt_data, prompt_module
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from train_helpers import quiet_trainer

from astrai.data.rewards import register_reward
from astrai.inference import InferenceEngine
from astrai.model import preset_model
from astrai.model.value import ValueModel, load_value_model, save_value_model
from astrai.train.optim import adamw, constant
from astrai.train.strategies.grpo.generation import Generation
from astrai.train.strategies.ppo import CRITIC_DIR, PPOModule
from astrai.train.strategies.ppo.value_loss import clipped_value_loss

LENGTH_REWARD = "test_ppo_length"


@register_reward(LENGTH_REWARD)
def _length(record, completion):
    """Varies for a random policy, so the advantages are not all zero and the policy moves."""
    return float(len(completion) % 3)


@pytest.fixture(scope="module")
def prompt_setup(tmp_path_factory):
    return prompt_data(tmp_path_factory.mktemp("ppo"))


def make_ppo(root: Path, **kw: Any) -> PPOModule:
    """A `PPOModule` on the tiny preset, seeded as `make_grpo` (equal policies)."""
    torch.manual_seed(0)
    args: dict[str, Any] = dict(
        model=functools.partial(preset_model, "tiny", vocab_size=320),
        optimizer=functools.partial(adamw, lr=1e-3),
        scheduler=constant,
        tokenizer=str(root / "tok"),
        num_generations=2,
        max_new_tokens=6,
        rewards=[{"name": LENGTH_REWARD, "weight": 1.0}],
        kl_coef=0.1,
        epsilon=0.2,
        engine=functools.partial(InferenceEngine, max_batch_size=16, max_seq_len=64),
        critic={"lr": 1e-3, "vf_coef": 0.5, "cliprange_value": 0.2},
        lam=0.95,
    )
    args.update(kw)
    return PPOModule(**args)


# ---------------------------------------------------------------------- the loss
def _generation() -> Generation:
    """Two completions of one prompt with fixed per-token advantages, values and returns."""
    g = torch.Generator().manual_seed(3)
    prompt = [5, 9, 14, 20]
    completions = [[30, 31, 32], [40, 41, 42, 43, 44]]

    def per_token(scale: float) -> list[list[float]]:
        return [(torch.randn(len(c), generator=g) * scale).tolist() for c in completions]

    return Generation(
        prompt_ids=[prompt],
        prompts=[prompt, prompt],
        completions=completions,
        logprobs=[(-torch.rand(len(c), generator=g) * 4).tolist() for c in completions],
        truncated=[False, False],
        advantages=per_token(1.0),
        bounds=[(0, 2)],
        repeats=1,
        values=per_token(0.5),
        returns=per_token(1.0),
    )


def _grads(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in module.named_parameters() if p.grad is not None}


def test_the_policy_loss_is_grpos_at_equal_advantages(prompt_setup):
    """Equal policies, equal generation (advantages given): PPO's loss is GRPO's loss (called
    on a GRPOModule) plus vf_coef * TRL's value loss; the policy's gradients are GRPO's, bit
    for bit, and the critic's are the value loss's alone."""
    root, tok = prompt_setup
    grpo = make_grpo(root, tok, rewards=[{"name": LENGTH_REWARD, "weight": 1.0}], loss_type="bnpo")
    ppo = make_ppo(root, loss_type="bnpo")
    for name, p in grpo.model.named_parameters():
        assert torch.equal(p, ppo.model.get_parameter(name))
    batch = {"prompt_ids": _generation().prompt_ids}
    grpo.generation, ppo.generation = _generation(), _generation()
    g_loss, g_metrics = grpo.compute_loss(batch)
    p_loss, p_metrics = ppo.compute_loss(batch)
    g_loss.backward()
    p_loss.backward()
    assert torch.equal(p_metrics["policy_loss"], g_loss.detach())
    for key in ("kl", "ratio", "clip_ratio/region_mean"):
        assert torch.equal(p_metrics[key], g_metrics[key])
    grads = _grads(ppo.model)
    assert grads.keys() == _grads(grpo.model).keys()
    for name, grad in _grads(grpo.model).items():
        assert torch.equal(grads[name], grad), name

    part = _generation().slice(0, pad_id=0, device=torch.device("cpu"), mask_truncated=False)
    with torch.no_grad():
        values = ppo.critic(part.rollouts.input_ids)[:, :-1]
    vf, _ = clipped_value_loss(values, part.returns, part.values, part.loss_mask, 0.2)
    assert torch.allclose(p_loss.detach() - g_loss.detach(), 0.5 * vf, atol=1e-6)
    assert float(p_metrics["critic/value_loss"]) == pytest.approx(float(vf), abs=1e-6)
    assert all(p.grad is not None for p in ppo.critic.parameters())


def test_padding_free_forwards_give_the_padded_losses(prompt_setup):
    """``padding_free``: the critic runs on the packed rows like the policy; the value loss,
    the total loss and the critic's gradients equal the padded forward's."""
    root, _ = prompt_setup
    padded, packed = (
        make_ppo(root, loss_type="bnpo"),
        make_ppo(root, loss_type="bnpo", padding_free=True),
    )
    batch = {"prompt_ids": _generation().prompt_ids}
    padded.generation, packed.generation = _generation(), _generation()
    a_loss, a = padded.compute_loss(batch)
    b_loss, b = packed.compute_loss(batch)
    torch.testing.assert_close(b["critic/value_loss"], a["critic/value_loss"], rtol=0, atol=1e-6)
    torch.testing.assert_close(b_loss, a_loss, rtol=0, atol=1e-6)
    a_loss.backward()
    b_loss.backward()
    b_grads = _grads(packed.critic)
    for name, grad in _grads(padded.critic).items():
        torch.testing.assert_close(b_grads[name], grad, rtol=1e-4, atol=1e-6)


def test_kl_in_reward_takes_the_kl_out_of_the_loss(prompt_setup):
    root, _ = prompt_setup
    ppo = make_ppo(root, use_kl_in_reward=True, kl_penalty="low_var_kl")
    assert ppo.loss_kl_coef == 0.0 and ppo.reference is not None
    ppo.generation = _generation()
    _, metrics = ppo.compute_loss({"prompt_ids": _generation().prompt_ids})
    assert "kl" not in metrics  # no reference forward in the loss


# ---------------------------------------------------------------------- options
@pytest.mark.parametrize(
    "kw, message",
    [
        ({"critic": {"init": "/no/such/critic"}}, "critic.init.*not found"),
        ({"critic": {"lr": 0}}, "critic.lr"),
        ({"critic": {"cliprange_value": 0.0}}, "critic.cliprange_value"),
        ({"critic": {"cliprange_value": -1}}, "critic.cliprange_value"),
        ({"critic": {"vf_coef": -0.1}}, "critic.vf_coef"),
        ({"critic": {"warmup_steps": -1}}, "critic.warmup_steps"),
        ({"critic": {"grad_clip": 0}}, "critic.grad_clip"),
        ({"critic": {"lr_critic": 1e-5}}, "unknown key.*lr_critic"),
        ({"lam": 1.5}, "lam"),
        ({"lam": -0.1}, "lam"),
        ({"gamma": 1.01}, "gamma"),
        ({"kl_penalty": "k4"}, "kl_penalty"),
        ({"use_kl_in_reward": True, "kl_coef": 0.0}, "use_kl_in_reward.*kl_coef"),
        ({"num_generations": 0}, "num_generations"),
        ({"lora": {"r": 4}}, "lora"),
        ({"async_rollouts": {"max_staleness": 1}}, "async_rollouts"),
        ({"advantage": "rloo"}, "advantage.*GAE"),
        ({"scale_rewards": "batch"}, "scale_rewards.*GAE"),
        ({"multi_objective_aggregation": "normalize_then_sum"}, "multi_objective_aggregation"),
    ],
)
def test_bad_settings_are_refused_before_the_model_is_built(prompt_setup, tmp_path, kw, message):
    root, _ = prompt_setup

    def no_model(**_: Any) -> Any:
        raise AssertionError("the model was built before the options were checked")

    with pytest.raises(ValueError, match=message):
        make_ppo(root, model=no_model, **kw)


def test_a_critic_path_that_is_not_a_model_is_refused_before_loading(prompt_setup, tmp_path):
    root, _ = prompt_setup
    (tmp_path / "empty").mkdir()
    (tmp_path / "tok_only").mkdir()
    (tmp_path / "tok_only" / "config.json").write_text(
        '{"architectures": ["LlamaForTokenClassification"]}'
    )

    def no_model(**_: Any) -> Any:
        raise AssertionError("the model was built before the options were checked")

    for path, what in [(tmp_path / "empty", "config.json"), (root / "tok", "")]:
        with pytest.raises(ValueError, match=f"critic.init.*{path}.*{what}"):
            make_ppo(root, model=no_model, critic={"init": str(path)})
    with pytest.raises(ValueError, match=r"critic\.init"):
        make_ppo(root, model=no_model, critic={"init": str(tmp_path / "tok_only")})


def test_one_completion_per_prompt_trains(prompt_setup, tmp_path):
    """``num_generations: 1`` (verl's PPO default): GRPO refuses it, PPO trains with it."""
    root, tok = prompt_setup
    with pytest.raises(ValueError, match="num_generations"):
        make_grpo(root, tok, num_generations=1)
    module = make_ppo(root, num_generations=1)
    assert module.options.num_generations == 1
    before = {k: v.clone() for k, v in module.critic.state_dict().items()}
    trainer = quiet_trainer(default_root_dir=tmp_path, max_steps=2, limit_val_batches=0)
    trainer.fit(module, datamodule=prompt_module(root, batch_size=4))
    assert len(module.generation.completions) == 4
    assert any(not torch.equal(before[k], v) for k, v in module.critic.state_dict().items())


def test_the_critic_starts_from_a_given_export(prompt_setup, tmp_path):
    root, _ = prompt_setup
    torch.manual_seed(5)
    source = ValueModel.from_policy(preset_model("tiny", vocab_size=320))
    save_value_model(source, tmp_path / "critic")
    ppo = make_ppo(root, critic={"init": str(tmp_path / "critic")})
    for name, p in source.state_dict().items():
        assert torch.equal(ppo.critic.state_dict()[name], p), name


# ---------------------------------------------------------------------- a short run
class _Snapshots(Callback):
    """The policy's and the critic's weights after every optimizer step."""

    def __init__(self) -> None:
        self.policy: list[dict[str, torch.Tensor]] = []
        self.critic: list[dict[str, torch.Tensor]] = []

    def on_train_batch_end(self, trainer, pl_module, *args: Any) -> None:
        self.policy.append({k: v.clone() for k, v in pl_module.model.state_dict().items()})
        self.critic.append({k: v.clone() for k, v in pl_module.critic.state_dict().items()})


STEPS = 6
RUN = dict(num_iterations=2, critic={"lr": 1e-3, "warmup_steps": 2, "grad_clip": 0.5})


def _fit(root: Path, where: Path, *, ckpt_path: Path | None = None, callbacks=()) -> PPOModule:
    module = make_ppo(root, **RUN)
    ckpt = ModelCheckpoint(dirpath=where, filename="s{step}", every_n_train_steps=1, save_top_k=-1)
    trainer = quiet_trainer(
        default_root_dir=where,
        max_steps=STEPS,
        callbacks=[ckpt, *callbacks],
        enable_checkpointing=True,
        limit_val_batches=0,
        use_distributed_sampler=False,
        gradient_clip_val=1.0,
    )
    trainer.fit(module, datamodule=prompt_module(root, batch_size=2), ckpt_path=ckpt_path)
    return module


def test_a_short_run_trains_the_critic_alone_then_both_and_resumes_exactly(prompt_setup, tmp_path):
    """Six steps (mu = 2: the second step of each generation batch reuses it; the critic
    trains alone in the first two): the critic moves at every step, the policy not before
    step 3, then does; the export holds the critic, which loads back bit for bit; resumed
    from every checkpoint (between the two passes of a generation batch, during and after
    the warm-up) the run ends where the uninterrupted one does, critic included."""
    root, _ = prompt_setup
    start = make_ppo(root, **RUN)
    first_policy = {k: v.clone() for k, v in start.model.state_dict().items()}
    first_critic = {k: v.clone() for k, v in start.critic.state_dict().items()}
    snaps = _Snapshots()
    module = _fit(root, tmp_path / "ref", callbacks=[snaps])
    assert len(snaps.policy) == STEPS
    before = [first_critic, *snaps.critic]
    for step in range(STEPS):
        assert any(not torch.equal(before[step][k], v) for k, v in snaps.critic[step].items())
    for step in range(2):
        assert all(torch.equal(first_policy[k], v) for k, v in snaps.policy[step].items())
    assert any(not torch.equal(first_policy[k], v) for k, v in snaps.policy[-1].items())

    module.save_pretrained(tmp_path / "export")
    critic = load_value_model(tmp_path / "export" / CRITIC_DIR)
    for name, p in module.critic.state_dict().items():
        assert torch.equal(critic.state_dict()[name], p), name

    final = {k: v.clone() for k, v in module.state_dict().items()}
    assert any(k.startswith("critic.") for k in final)
    saved = sorted(p.name for p in (tmp_path / "ref").glob("s*.ckpt"))
    mid = [
        n
        for n in saved
        if "grpo_generation" in torch.load(tmp_path / "ref" / n, weights_only=False)
    ]
    assert mid, "no checkpoint between the two passes of a generation batch"
    for name in saved:
        if f"step={STEPS}" in name:
            continue
        resumed = _fit(root, tmp_path / name, ckpt_path=tmp_path / "ref" / name)
        state = resumed.state_dict()
        different = [k for k, v in final.items() if not torch.equal(state[k], v)]
        assert not different, f"resumed from {name}: {different}"
