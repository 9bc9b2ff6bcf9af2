"""GRPO's generation batches: ``num_iterations`` (mu), ``steps_per_generation``, the data
module's batch reuse, and that the defaults are the plain one-update-per-rollout GRPO."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from grpo_helpers import TINY_GRPO_CLI, make_grpo, prompt_data, prompt_module
from lightning.pytorch.callbacks import Callback
from train_helpers import quiet_trainer

from astrai.data import BatchReuse
from astrai.data.rewards import register_reward
from astrai.data.sampler import BatchConsumer
from astrai.inference import InferenceEngine
from astrai.train.module import token_logprobs
from astrai.train.strategies.grpo import parse_rewards, score
from astrai.train.strategies.grpo.advantages import group_advantages
from astrai.train.strategies.grpo.generation import build_rollouts
from astrai.train.strategies.grpo.loss import grpo_loss

LENGTH_REWARD = "test_grpo_reuse_length"


@register_reward(LENGTH_REWARD)
def _length(record, completion):
    """Varies for a random policy, so the advantages are not all zero and the policy moves."""
    return float(len(completion) % 3)


@pytest.fixture(scope="module")
def prompt_setup(tmp_path_factory):
    return prompt_data(tmp_path_factory.mktemp("grpo-reuse"))


class _Record(Callback):
    """Every micro-step's logged metrics, and the engine calls' prompt counts."""

    def __init__(self) -> None:
        self.steps: list[dict[str, float]] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.steps.append({k: float(v) for k, v in trainer.callback_metrics.items()})


def _count_generations(module) -> list[int]:
    calls: list[int] = []
    original = module.live_source.generate

    def counting(prompts, **kw):
        calls.append(len(prompts))
        return original(prompts, **kw)

    module.live_source.generate = counting
    return calls


# ------------------------------------------------------------------ the defaults
def test_defaults_equal_a_plain_grpo_loop(prompt_setup):
    """num_iterations 1 and steps_per_generation 1 are today's algorithm, bit for bit: per
    batch, G rollouts per prompt (the engine's old one-request-per-completion call, seeded
    rollout_seed + micro-steps so far * completions), group advantages, one AdamW step."""
    root, tok = prompt_setup
    # the plain loop below takes log-probs from the full logits: the module's dense path
    # (the chunked head equals it to 1e-6, not bit for bit: tests/train/test_logits_chunk_size.py)
    kw = dict(
        loss_type="bnpo",
        kl_coef=0.1,
        rollout_seed=7,
        epsilon_high=0.28,
        rewards=[LENGTH_REWARD],
        logits_chunk_size=None,
    )
    module = make_grpo(root, tok, **kw)
    trainer = quiet_trainer(max_steps=3, limit_val_batches=0, use_distributed_sampler=False)
    trainer.fit(module, datamodule=prompt_module(root))

    by_hand = make_grpo(root, tok, **kw)  # the same initial weights
    model, reference = by_hand.model, by_hand.reference.model
    optimizer = by_hand.configure_optimizers()["optimizer"]
    engine = InferenceEngine(model, by_hand.tokenizer, max_batch_size=16, max_seq_len=64)
    rewards = parse_rewards([LENGTH_REWARD])
    loader = prompt_module(root).train_dataloader()
    g, params = 4, by_hand.live_source.params
    single = dataclasses.replace(params, n=1)
    for step, batch in zip(range(3), loader):
        prompts = [p for p in batch["prompt_ids"] for _ in range(g)]
        records = [r for r in batch["records"] for _ in range(g)]
        with torch.no_grad():
            results = engine.run_batch(
                prompts, single, seed=7 + (step + 1) * len(prompts), return_details=True
            )
        texts = [tok.decode(r.token_ids, skip_special_tokens=True) for r in results]
        reward, _ = score(records, texts, rewards)
        adv = group_advantages(reward.view(-1, g), 1e-4).flatten()
        r = build_rollouts(
            prompts, [x.token_ids for x in results], [x.logprobs for x in results], pad_id=0
        )
        targets = r.input_ids[:, 1:]
        logp = token_logprobs(model(r.input_ids)[:, :-1], targets)
        with torch.no_grad():
            ref = token_logprobs(reference(r.input_ids)[:, :-1], targets)
        loss, _ = grpo_loss(
            logp,
            r.old_logp,
            adv,
            r.mask,
            loss_type="bnpo",
            epsilon=0.2,
            epsilon_high=0.28,
            ref_logp=ref,
            kl_coef=0.1,
            use_bias_correction_kl=True,
            max_completion_length=6,
        )
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        engine.update_weights(version=step + 1)
    engine.shutdown()
    initial = make_grpo(root, tok, **kw).model.state_dict()
    for key, value in by_hand.model.state_dict().items():
        assert torch.equal(module.model.state_dict()[key], value), key
    assert any(not torch.equal(initial[k], v) for k, v in by_hand.model.state_dict().items())


# ------------------------------------------------------------------ num_iterations
def test_two_iterations_engage_the_clip(prompt_setup):
    """mu = 2: the second pass over a generation batch sees a policy that moved (one AdamW
    step), so its ratios leave [1 - epsilon, 1 + epsilon_high] and the clip ratio is
    non-zero; the first pass is on-policy (ratio 1, nothing clipped). One engine call per
    generation batch, every batch trained on twice."""
    root, tok = prompt_setup
    module = make_grpo(
        root,
        tok,
        num_iterations=2,
        epsilon_high=0.28,
        kl_coef=0.0,
        rewards=[LENGTH_REWARD],
        max_new_tokens=12,
        optimizer=lambda m: torch.optim.AdamW(m.parameters(), lr=3e-2),
    )
    calls = _count_generations(module)
    record = _Record()
    trainer = quiet_trainer(
        max_steps=4, limit_val_batches=0, use_distributed_sampler=False, callbacks=[record]
    )
    trainer.fit(module, datamodule=prompt_module(root))
    assert calls == [2, 2]  # 2 prompts per generation, 2 generations for 4 steps
    clip = [s["train/clip_ratio/region_mean"] for s in record.steps]
    ratio = [s["train/ratio"] for s in record.steps]
    assert clip[0] == 0.0 and clip[2] == 0.0, clip  # first use: on-policy
    assert ratio[0] == pytest.approx(1.0, abs=1e-5)
    assert clip[1] > 0.0 and clip[3] > 0.0, clip  # second use: the policy moved
    assert module.batch_reuse == BatchReuse(group=1, repeat=2)


def test_steps_per_generation_splits_one_generation(prompt_setup):
    """steps_per_generation 2: the prompts of two micro-steps are generated at once, shuffled
    and split; each micro-step trains on half the completions, each completion once."""
    root, tok = prompt_setup
    module = make_grpo(root, tok, steps_per_generation=2, kl_coef=0.0)
    calls = _count_generations(module)
    seen: list[list[int]] = []
    original = module.compute_loss

    def compute_loss(batch):
        out = original(batch)
        gen = module.generation
        start, end = gen.bounds[(gen.used - 1) % len(gen.bounds)]
        seen.append(list(range(start, end)))
        return out

    module.compute_loss = compute_loss
    trainer = quiet_trainer(max_steps=2, limit_val_batches=0, use_distributed_sampler=False)
    trainer.fit(module, datamodule=prompt_module(root))
    assert calls == [4]  # 2 micro-steps x 2 prompts, one engine call
    assert seen == [list(range(8)), list(range(8, 16))]
    gen = module.generation
    assert sorted(map(tuple, gen.prompts)) == sorted(
        tuple(p) for p in gen.prompt_ids for _ in range(4)
    )
    assert [tuple(p) for p in gen.prompts] != [tuple(p) for p in gen.prompt_ids for _ in range(4)]


def test_steps_per_generation_null_is_the_accumulation(prompt_setup):
    root, tok = prompt_setup
    module = make_grpo(root, tok, steps_per_generation=None, kl_coef=0.0)
    calls = _count_generations(module)
    trainer = quiet_trainer(
        max_steps=1,
        accumulate_grad_batches=3,
        limit_val_batches=0,
        use_distributed_sampler=False,
    )
    trainer.fit(module, datamodule=prompt_module(root))
    assert module.batch_reuse == BatchReuse(group=3, repeat=3)
    assert calls == [6]


# ------------------------------------------------------------------ the data module
def test_the_loader_repeats_batches_and_resumes_mid_repeat(prompt_setup):
    """Each loader batch goes to `repeat` steps; a position saved after some of them resumes
    with the rest of that batch, then the next ones."""
    root, _ = prompt_setup
    dm = prompt_module(root)
    plain = [b["prompt_ids"] for b in prompt_module(root, batch_size=4).train_dataloader()]
    loader = _loader_with(dm, BatchReuse(group=2, repeat=3))
    got = []
    for i, b in enumerate(loader):
        got.append(b["prompt_ids"])
        if i == 4:  # two full batches would be 6 steps: stop in the middle of the second
            state = dm.state_dict()
            break
    assert got == [plain[0]] * 3 + [plain[1]] * 2
    assert state["consumed"] == 4 and state["repeats"] == 2 and state["reuse"] == [2, 3]
    resumed = prompt_module(root)
    resumed.load_state_dict(state)
    rest = [b["prompt_ids"] for b in _loader_with(resumed, BatchReuse(group=2, repeat=3))]
    assert rest[:4] == [plain[1]] + [plain[2]] * 3
    assert len(rest) == (len(plain) - 1) * 3 - 2
    with pytest.raises(ValueError, match="num_iterations"):
        mismatch = prompt_module(root)
        mismatch.load_state_dict(state)
        _loader_with(mismatch, BatchReuse(group=1, repeat=3))


def _loader_with(dm, reuse):
    """The training loader as a trainer whose module declares `reuse` would get it."""

    class Module(BatchConsumer):
        batch_reuse = reuse

    class Trainer:
        lightning_module = Module()
        global_rank, world_size, training = 0, 1, False

    dm.trainer = Trainer()
    try:
        return dm.train_dataloader()
    finally:
        dm.trainer = None


# ------------------------------------------------------------------ bad options
@pytest.mark.parametrize(
    ("option", "value", "message"),
    [
        ("num_iterations", 0, "num_iterations must be an int >= 1"),
        ("steps_per_generation", 0, "steps_per_generation must be an int >= 1"),
        ("advantage", "ppo", "advantage must be one of"),
        ("scale_rewards", "token", "scale_rewards='token' does not apply"),
        ("importance_sampling_level", "group", "importance_sampling_level must be one of"),
        ("delta", 1.1, "delta .* must be > 1 \\+ epsilon_high"),
        ("top_entropy_quantile", 1.5, "top_entropy_quantile must be in"),
        ("gamma", 0.0, "gamma .* must be in"),
    ],
)
def test_bad_options_are_named(prompt_setup, option, value, message):
    root, tok = prompt_setup
    with pytest.raises(ValueError, match=message):
        make_grpo(root, tok, **{option: value})


def test_rloo_refuses_group_scaling(prompt_setup):
    root, tok = prompt_setup
    with pytest.raises(
        ValueError, match="scale_rewards='group' does not apply to advantage='rloo'"
    ):
        make_grpo(root, tok, advantage="rloo", scale_rewards="group")
    make_grpo(root, tok, advantage="rloo", scale_rewards=None, kl_coef=0.0)  # its default: none


# ------------------------------------------------------------------ through the CLI
HERE_ENV = {"PYTHONPATH": str(Path(__file__).resolve().parent)}  # _callbacks and _rewards


@pytest.mark.slow
def test_kill_between_iterations_resumes_bit_identical(tmp_path, data_dir):
    """mu = 2 through `python -m astrai.train`: a checkpoint after every optimizer step, so the
    odd ones fall between the two passes over a generation batch. Killed in the step after
    the first of those and resumed with ckpt_path=last, the run ends with the uninterrupted
    one's weights and optimizer state, bit for bit: the rollouts and the data position's
    place in the batch's reuse travel in the checkpoint. (Resuming between two batches is
    the plain case of tests/train/test_resume.py.)"""
    from train_helpers import checkpoint_differences, cli, run_dirs

    run = [
        *TINY_GRPO_CLI,
        "data.batch_size=2",
        "callbacks.model_checkpoint.every_n_train_steps=1",
        "callbacks.model_checkpoint.save_top_k=-1",
        "trainer.max_steps=4",
    ]
    env = HERE_ENV
    cli([*run, *run_dirs(tmp_path / "ref", data_dir)], env=env)
    for step in (1,):  # between the two passes over the first batch
        where = tmp_path / f"kill{step}"
        args = [*run, *run_dirs(where, data_dir)]
        killed = cli(
            [
                *args,
                "+callbacks.kill._target_=_callbacks.KillAtStep",
                f"+callbacks.kill.step={step}",
            ],
            check=False,
            env=env,
        )
        assert killed.returncode == -9, killed.stderr[-3000:]
        cli([*args, "ckpt_path=last"], env=env)
        different = checkpoint_differences(tmp_path / "ref" / "run", where / "run", 4)
        assert not different, f"killed at step {step}: {different}"
    saved = torch.load(
        tmp_path / "kill1" / "run" / "checkpoints" / "step000001.ckpt", weights_only=False
    )
    assert saved["grpo_generation"]["used"] == 1  # written between the two passes
    initial = torch.load(tmp_path / "ref" / "run" / "checkpoints" / "step000001.ckpt")
    final = torch.load(tmp_path / "ref" / "run" / "checkpoints" / "last.ckpt")
    assert any(  # the policy moved: the comparison above is not of untouched weights
        not torch.equal(v, final["state_dict"][k]) for k, v in initial["state_dict"].items()
    )


@pytest.mark.slow
def test_ddp_two_ranks_match_one_process_with_the_options(tmp_path, data_dir):
    """Two DDP processes of 1 prompt each equal one process of 2 prompts, with the options
    whose statistics span the batch: batch-scaled advantages (a std over both ranks), the
    entropy quantile (over both ranks' tokens), dapo's token count, mu = 2."""
    from safetensors.torch import load_file
    from train_helpers import cli

    common = [
        *TINY_GRPO_CLI,
        "name=grpo_ddp",
        "strategy.scale_rewards=batch",
        "strategy.top_entropy_quantile=0.5",
        "trainer.max_steps=4",
        "callbacks.model_checkpoint.every_n_train_steps=1",
        "callbacks.model_checkpoint.save_top_k=-1",
        f"paths.data_dir={data_dir}",
    ]
    cli([*common, "data.batch_size=2", f"paths.log_dir={tmp_path / 'one'}"], env=HERE_ENV)
    ddp = ["trainer=ddp", "trainer.accelerator=cpu", "trainer.devices=2", "data.batch_size=1"]
    cli([*common, *ddp, f"paths.log_dir={tmp_path / 'two'}"], env=HERE_ENV)
    (one,) = [p for p in (tmp_path / "one" / "grpo_ddp").iterdir() if not p.is_symlink()]
    (two,) = [p for p in (tmp_path / "two" / "grpo_ddp").iterdir() if not p.is_symlink()]
    w1 = load_file(one / "export" / "model.safetensors")
    w2 = load_file(two / "export" / "model.safetensors")
    first = torch.load(one / "checkpoints" / "step000001.ckpt")["state_dict"]
    last = torch.load(one / "checkpoints" / "last.ckpt")["state_dict"]
    assert any(not torch.equal(v, last[k]) for k, v in first.items())  # the policy moved
    # The all-reduce adds the two ranks' gradients in another order than one process does,
    # and Adam divides each coordinate by its own gradient scale, so a coordinate whose
    # gradients are tiny carries that rounding into its step: on an Intel Xeon one of 11,264
    # weights ended 1.9e-5 apart after 4 steps (1e-5 passed on AMD EPYC). A wrong statistic
    # over the ranks moves weights by the step size, lr = 1e-2: 100x this tolerance.
    for k in w1:
        torch.testing.assert_close(w2[k], w1[k], rtol=1e-4, atol=1e-4)


# ------------------------------------------------------------------ everything at once
EVERY_OPTION = dict(
    num_iterations=2,
    steps_per_generation=2,
    advantage="rloo",
    scale_rewards="batch",
    importance_sampling_level="sequence",
    delta=2.0,
    top_entropy_quantile=0.5,
    mask_truncated_completions=True,
    loss_type="dapo",
    kl_coef=0.1,
    sync_interval=2,
    sync_alpha=0.5,
    epsilon_high=0.28,
    lora={"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"]},
    rewards=[LENGTH_REWARD],
    optimizer=lambda m: torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=1e-2),
)


def _fit_every_option(root, tok, tmp_path, *, ckpt_path=None):
    """Four optimizer steps of 2 accumulated micro-batches with every option on (8
    micro-steps: two generation batches of 2 x 2 prompts, each served 4 times); a checkpoint
    after every optimizer step."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    module = make_grpo(root, tok, **EVERY_OPTION)
    ckpt = ModelCheckpoint(
        dirpath=tmp_path, filename="s{step}", every_n_train_steps=1, save_top_k=-1
    )
    trainer = quiet_trainer(
        default_root_dir=tmp_path,
        max_steps=4,
        accumulate_grad_batches=2,
        callbacks=[ckpt],
        enable_checkpointing=True,
        limit_val_batches=0,
        use_distributed_sampler=False,
    )
    trainer.fit(module, datamodule=prompt_module(root), ckpt_path=ckpt_path)
    return {k: v.clone() for k, v in module.state_dict().items()}, module


@pytest.mark.slow
def test_every_option_together_trains_and_resumes_exactly(prompt_setup, tmp_path):
    """The options compose with each other, accumulation, LoRA, a moving reference and
    resume: resumed from the checkpoint of step 1 (in the middle of the first generation
    batch's reuse), the run ends where the uninterrupted one does, bit for bit."""
    root, tok = prompt_setup
    final, module = _fit_every_option(root, tok, tmp_path / "a")
    assert module.batch_reuse == BatchReuse(group=2, repeat=4)
    (mid,) = (tmp_path / "a").glob("s*1.ckpt")
    saved = torch.load(mid, weights_only=False)
    assert saved["grpo_generation"]["used"] == 2  # 2 of the batch's 4 micro-steps served
    resumed, _ = _fit_every_option(root, tok, tmp_path / "b", ckpt_path=mid)
    initial = make_grpo(root, tok, **EVERY_OPTION).state_dict()
    assert any(not torch.equal(initial[k], v) for k, v in final.items())
    for key, value in final.items():
        assert torch.equal(resumed[key], value), key
