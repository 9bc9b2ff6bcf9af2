"""The memory plan (astrai/train/memory_plan.py, memory_plan_config.py): every row against
arithmetic done here from the config's fields, its reading of a composed config, the table
it logs before anything loads, and `plan_only=true`."""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

import pytest
from train_helpers import cli

from astrai.model.config import ModelConfig
from astrai.train import memory_plan_config, runner
from astrai.train.memory_plan import (
    GIB,
    GPU_RUNTIME,
    LOGITS_COPIES,
    EngineShape,
    Layout,
    Workload,
    describe,
    plan_memory,
    value_model_params,
)
from astrai.train.memory_plan_config import config_plan, log_plan
from astrai.train.model_shape import model_shape
from astrai.train.runner import compose

SMALL = ModelConfig(
    vocab_size=1000,
    hidden_size=64,
    intermediate_size=160,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    tie_word_embeddings=False,
    qk_norm=True,
)


def _params(c: ModelConfig) -> int:
    """Parameters by hand: embedding + untied head + blocks (q, k, v, o, q/k norms, SwiGLU,
    two norms) + the final norm."""
    h, q, kv = c.hidden_size, c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
    block = h * q + 2 * h * kv + q * h + 2 * c.head_dim + 3 * h * c.intermediate_size + 2 * h
    return 2 * c.vocab_size * h + c.num_hidden_layers * block + h


def _widths(c: ModelConfig) -> tuple[int, int, int, int]:
    return (
        c.hidden_size,
        c.num_attention_heads * c.head_dim,
        c.num_key_value_heads * c.head_dim,
        c.intermediate_size,
    )


ENGINE = EngineShape(kv_tokens=4096, max_batch_size=8, max_prefill_tokens=256, logprob_chunk=64)
WORK = Workload(
    micro_batch_tokens=8 * 512,
    logits_chunk_size=128,
    gradient_checkpointing=True,
    reference_bytes=2,
    engine=ENGINE,
)


def test_fsdp2_rows_are_the_hand_arithmetic() -> None:
    n, (h, q, kv, inter), L, V = _params(SMALL), _widths(SMALL), 3, 1000
    world = 4
    layout = Layout(
        world_size=world, fully_sharded=True, master_bytes=4, compute_bytes=2, shard_bytes=2
    )
    plan = plan_memory(SMALL, layout, WORK)
    assert plan.weights == plan.gradients == n * 4 // world
    assert plan.optimizer == 2 * n * 4 // world  # AdamW's two fp32 moments, sharded
    assert plan.optimizer_temporaries == n * 4 // world  # foreach: one state-sized temporary
    assert plan.reference == n * 2 // world  # bf16, sharded
    # the engine's full copy, allocated in the shards' dtype (fp32), and its packs and pool
    assert plan.engine_weights == n * 4
    assert plan.engine_packs == L * h * (q + 2 * kv + 2 * inter) * 4  # q/k/v + gate/up
    assert plan.kv_pool == 4096 * L * 2 * (SMALL.num_key_value_heads * SMALL.head_dim) * 4
    # activations: block inputs (bf16 residual under param_dtype) + one block recomputed
    # (its norms; q and k projected, qk-normed and rotated; v; the attention output and its
    # copy; the MLP's four) + the final norm's input and output
    layer = 2 * 4 * h + 2 * (5 * q + 4 * kv + 4 * inter)
    assert plan.activations == 8 * 512 * (L * 2 * h + layer + 2 * 2 * h)
    assert plan.logits == 128 * V * 4 * LOGITS_COPIES  # one chunk of the head
    # gathered in bf16: the root (embedding, head, final norm) + 2 blocks + a block's gradient
    block = (n - 2 * V * h - h) // L
    assert plan.compute_weights == (2 * V * h + h + 3 * block) * 2
    assert plan.runtime == 0  # not a GPU layout
    # the phases are the sums of what is alive in them
    shared = plan.weights + plan.optimizer + plan.reference + plan.engine_weights
    engine = plan.engine_packs + plan.kv_pool
    assert plan.rollout == shared + engine + plan.rollout_workspace
    assert plan.update == (
        shared + plan.gradients + engine + plan.compute_weights + plan.activations + plan.logits
    )
    assert plan.step == shared + plan.gradients + engine + plan.optimizer_temporaries
    assert plan.peak == max(plan.rollout, plan.update, plan.step)


def test_sleep_releases_the_kv_pool_and_packs_from_each_rollout_to_the_next() -> None:
    """GRPO puts the engine to sleep after each rollout (TRL's window) and
    `on_before_optimizer_step` before each step: the forward, the backward and the optimizer
    step run without its KV pool and packs."""
    layout = Layout(world_size=2, fully_sharded=True, shard_bytes=2, compute_bytes=2)
    awake = plan_memory(SMALL, layout, WORK)
    asleep_work = dataclasses.replace(WORK, engine=dataclasses.replace(ENGINE, sleep=True))
    asleep = plan_memory(SMALL, layout, asleep_work)
    assert asleep.step == awake.step - awake.kv_pool - awake.engine_packs
    assert asleep.update == awake.update - awake.kv_pool - awake.engine_packs
    assert asleep.rollout == awake.rollout  # rollouts need the engine whole
    assert asleep.engine_weights == awake.engine_weights  # its weights copy stays


def test_a_token_budget_bounds_one_forwards_activations_and_logits() -> None:
    layout = Layout(world_size=2, fully_sharded=True, shard_bytes=2, compute_bytes=2)
    whole = plan_memory(SMALL, layout, dataclasses.replace(WORK, logits_chunk_size=None))
    budget = 1024
    work = dataclasses.replace(WORK, logits_chunk_size=None, forward_tokens=budget)
    packed = plan_memory(SMALL, layout, work)
    assert packed.activations * WORK.micro_batch_tokens == whole.activations * budget
    assert packed.logits == budget * SMALL.vocab_size * 4 * LOGITS_COPIES


def test_ddp_replica_dense_head_without_checkpointing() -> None:
    n, (h, q, kv, inter), L, V = _params(SMALL), _widths(SMALL), 3, 1000
    layout = Layout(world_size=2, master_bytes=4, compute_bytes=2, mixed=True, gpu=True)
    work = Workload(micro_batch_tokens=2048, logits_chunk_size=None, engine=ENGINE)
    plan = plan_memory(SMALL, layout, work)
    assert plan.weights == plan.gradients == n * 4  # a whole replica on every rank
    assert plan.optimizer == 2 * n * 4
    assert plan.reference == 0
    assert plan.engine_weights == 0  # the engine generates with the live fp32 weights
    assert plan.kv_pool == 4096 * L * 2 * SMALL.num_key_value_heads * SMALL.head_dim * 4  # fp32
    # an fp32 residual stream; autocast's bf16 casts of both norms' outputs
    layer = 4 * 4 * h + 2 * (2 * h + 5 * q + 4 * kv + 4 * inter)
    assert plan.activations == 2048 * (L * layer + 2 * 4 * h)
    assert plan.logits == 2048 * V * 4 * LOGITS_COPIES  # the dense [tokens, vocab]
    assert plan.compute_weights == (n - V * h) * 2  # autocast's bf16 casts (not the embedding)
    assert plan.runtime == GPU_RUNTIME


@pytest.mark.parametrize("checkpointing", [False, True])
def test_activations_are_what_autograd_saves(checkpointing: bool) -> None:
    """The activation row against the bytes autograd keeps for backward in a real forward
    (`saved_tensors_hooks`, each storage once, the weights left out): fp32, one process. With
    checkpointing the forward keeps the block inputs; the plan adds the block recomputed in
    backward, which is not alive yet."""
    import torch

    from astrai.model import Transformer
    from astrai.train.memory_plan import layer_activation_bytes

    cfg = dataclasses.replace(SMALL, hidden_size=128, intermediate_size=352, num_hidden_layers=4)
    cfg = ModelConfig.from_dict(cfg.to_dict())
    torch.manual_seed(0)
    model = Transformer(cfg)
    model.gradient_checkpointing = checkpointing
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved: dict[int, int] = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in weights:
            saved[storage.data_ptr()] = storage.nbytes()
        return t

    ids = torch.randint(0, cfg.vocab_size, (2, 64))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(ids, return_hidden=True)
    layout = Layout()
    work = Workload(micro_batch_tokens=ids.numel(), gradient_checkpointing=checkpointing)
    planned = plan_memory(cfg, layout, work).activations
    if checkpointing:
        planned -= ids.numel() * layer_activation_bytes(cfg, layout)
    measured = sum(saved.values())
    assert planned <= measured <= 1.1 * planned, (measured, planned)


def test_tensor_parallel_splits_weights_and_the_wide_activations() -> None:
    one = plan_memory(SMALL, Layout(world_size=4, fully_sharded=True), WORK)
    tp = plan_memory(SMALL, Layout(world_size=4, tensor_parallel=2, fully_sharded=True), WORK)
    assert tp.weights == one.weights  # sharded over dp x tp = the same 4 ranks
    assert tp.logits == one.logits // 2  # the vocabulary-parallel head
    assert tp.activations < one.activations


def test_ppo_critic_is_a_second_trained_model_of_the_policys_shape() -> None:
    """The critic (its own backbone, no LM head, a hidden -> 1 head with a bias) is trained in
    a parameter group of the one optimizer: weights, gradients and AdamW's state as the
    policy's, its forward's activations as the policy's, each in the phases the policy's are."""
    import torch

    from astrai.model import Transformer
    from astrai.model.value import ValueModel

    tied = ModelConfig.from_dict({**SMALL.to_dict(), "tie_word_embeddings": True})
    torch.manual_seed(0)
    assert value_model_params(tied) == ValueModel.from_policy(Transformer(tied)).num_parameters()
    assert value_model_params(SMALL) == _params(SMALL) - 1000 * 64 + 64 + 1  # the head left out
    layout = Layout(master_bytes=4, compute_bytes=4)
    work = Workload(micro_batch_tokens=2048, reference_bytes=4, engine=ENGINE)
    policy = plan_memory(tied, layout, work)
    ppo = plan_memory(tied, layout, dataclasses.replace(work, critic=tied))
    head = (tied.hidden_size + 1) * 4  # the value head's fp32 bytes
    # the critic line: the policy's weights + gradients + optimizer bytes (and its head's)
    assert ppo.critic == policy.weights + policy.gradients + policy.optimizer + 4 * head
    assert ppo.critic_activations == policy.activations  # no LM head of its own
    assert ppo.optimizer_temporaries == policy.optimizer_temporaries + head  # the larger group
    held = ppo.critic_weights + ppo.critic_optimizer
    assert ppo.rollout == policy.rollout + held
    assert ppo.step == policy.step + ppo.critic + head
    assert ppo.update == policy.update + ppo.critic + ppo.critic_activations
    assert [r[0] for r in ppo.rows()][5:7] == [
        "critic: weights, gradients, optimizer state (fp32)",
        "critic activations (one forward)",
    ]
    assert ppo.as_dict()["critic_weights"] == ppo.critic_weights
    # over the device: no advice PPO refuses (trainer=fsdp2); the policy alone gets it
    assert "trainer=fsdp2" not in describe(ppo, 1)[1]
    assert "trainer=fsdp2" in describe(policy, 1)[1]
    assert not [r for r in policy.rows() if r[0].startswith(("critic", "teacher"))]


def _write_config(directory: Path, cfg: ModelConfig) -> Path:
    directory.mkdir(parents=True)
    cfg.save(directory / "config.json")
    return directory


def test_ppo_config_plans_its_critic(tmp_path: Path) -> None:
    cfg = compose(["experiment=tiny_ppo"])
    plan = config_plan(cfg)
    n = value_model_params(model_shape(cfg.model).config)
    assert plan.critic == n * 4 * (1 + 1 + 2)  # fp32 weights, gradients, AdamW's two moments
    assert "critic: weights, gradients, optimizer state" in plan.table()
    # a critic started from an export of another size is planned with its config.json
    other = dataclasses.replace(SMALL, num_hidden_layers=2)
    path = _write_config(tmp_path / "critic", other)
    loaded = config_plan(compose(["experiment=tiny_ppo", f"strategy.critic.init={path}"]))
    assert loaded.critic_weights == value_model_params(other) * 4
    assert config_plan(compose(["experiment=tiny_grpo"])).critic == 0


def test_distill_teacher_is_its_exports_parameters_in_its_dtype(tmp_path: Path) -> None:
    """The frozen teacher, loaded whole on every rank, from its own config.json (a size other
    than the student's); none in the stored top-k mode (no teacher path)."""
    teacher = dataclasses.replace(SMALL, hidden_size=96, num_hidden_layers=4)
    path = _write_config(tmp_path / "teacher", teacher)
    args = ["experiment=tiny_distill", f"strategy.teacher_model_name_or_path={path}"]
    plan = config_plan(compose(args))
    assert plan.teacher == _params(teacher) * 4  # no dtype: the policy's fp32 parameters
    bf16 = config_plan(compose([*args, "strategy.teacher_model_init_kwargs={dtype: bfloat16}"]))
    assert bf16.teacher == _params(teacher) * 2
    assert "teacher (bf16, frozen)" in bf16.table()
    stored = config_plan(
        compose(["experiment=tiny_distill", "strategy.teacher_model_name_or_path=null"])
    )
    assert stored.teacher == 0 and "teacher" not in stored.table()
    for phase in ("rollout", "update", "step"):
        assert getattr(plan, phase) == getattr(stored, phase) + plan.teacher, phase


# ---------------------------------------------------------------------- from the config
def _grpo_8b(*overrides: str):
    return compose(["experiment=grpo_8b", "model=qwen3-8b", *overrides])


def test_the_grpo_8b_config_is_read_as_its_keys_say() -> None:
    cfg = _grpo_8b()
    plan = config_plan(cfg)
    assert plan is not None
    lay, work = plan.layout, plan.workload
    assert (lay.fully_sharded, lay.world_size, lay.shard_bytes, lay.master_bytes) == (
        True,
        8,
        2,
        4,
    )
    assert lay.mixed and lay.gpu
    seq = cfg.data.train.prepare.max_length + cfg.strategy.max_new_tokens
    assert seq == cfg.strategy.engine.max_seq_len == 4096
    assert work.micro_batch_tokens == cfg.data.batch_size * cfg.strategy.num_generations * seq
    assert work.reference_bytes == 2 and work.gradient_checkpointing and work.fused_optimizer
    assert work.engine.kv_tokens == cfg.strategy.engine.kv_tokens == 16 * 4096
    assert work.engine.max_batch_size == 16
    n = model_shape(cfg.model).config.num_parameters()
    assert plan.weights == n * 4 // 8 and plan.engine_weights == n * 4


def test_chunk_and_sleep_keys_with_their_defaults() -> None:
    """`strategy.logits_chunk_size` absent: the chunked path's default; null: dense.
    `strategy.engine.enable_sleep_mode` absent: awake."""
    cfg = _grpo_8b()
    plan = config_plan(cfg)
    if "logits_chunk_size" not in cfg.strategy:
        assert plan.workload.logits_chunk_size == 1024
    dense = config_plan(_grpo_8b("++strategy.logits_chunk_size=null"))
    assert dense.workload.logits_chunk_size is None
    # the recipe's forwards hold at most ppo_max_token_len_per_gpu tokens (use_dynamic_bsz)
    assert dense.workload.forward_tokens == 8192
    assert dense.logits == dense.workload.forward_tokens * 151936 * 4 * LOGITS_COPIES
    chunked = "++strategy.logits_chunk_size=1024"
    whole = ("++strategy.use_dynamic_bsz=false", "++strategy.padding_free=false")
    awake = config_plan(_grpo_8b(chunked, "++strategy.engine.enable_sleep_mode=false", *whole))
    asleep = config_plan(_grpo_8b(chunked, "++strategy.engine.enable_sleep_mode=true", *whole))
    assert asleep.sleep and not awake.sleep
    assert asleep.step == awake.step - awake.kv_pool - awake.engine_packs
    assert awake.workload.forward_tokens is None  # padding_free / use_dynamic_bsz off
    budget = [
        "++strategy.padding_free=true",
        "++strategy.use_dynamic_bsz=true",
        "++strategy.ppo_max_token_len_per_gpu=8192",
    ]
    after_merge = config_plan(
        _grpo_8b(chunked, "++strategy.engine.enable_sleep_mode=true", *budget)
    )
    assert after_merge.workload.forward_tokens == 8192
    # the recipe's claim (docs/scaling.md): on 8 x 80 GiB it fits with its chunked head,
    # token budget and sleep; with one whole micro-batch per forward it does not
    assert after_merge.fits(80 * GIB) and not asleep.fits(80 * GIB)
    assert config_plan(_grpo_8b()).peak == after_merge.peak  # the recipe as written


def test_kl_coef_zero_keeps_no_reference_and_ddp_keeps_a_replica() -> None:
    plan = config_plan(_grpo_8b("strategy.kl_coef=0"))
    assert plan.reference == 0
    ddp = config_plan(_grpo_8b("trainer=ddp", "trainer.devices=8"))
    assert not ddp.layout.fully_sharded and ddp.engine_weights == 0
    assert ddp.weights == model_shape(_grpo_8b().model).config.num_parameters() * 4


def test_a_model_directory_not_given_has_no_plan() -> None:
    cfg = compose(["experiment=grpo_8b"])
    assert model_shape(cfg.model) is None and config_plan(cfg) is None


def test_a_plan_over_the_device_is_a_warning_with_the_numbers(caplog) -> None:
    cfg = _grpo_8b("device_memory_gib=24")
    with caplog.at_level(logging.INFO, logger=memory_plan_config.__name__):
        plan = log_plan(cfg)
    record = caplog.records[-1]
    assert record.levelno == logging.WARNING
    assert f"{plan.peak / GIB:.2f} GiB" in record.getMessage()
    assert "24.00 GiB" in record.getMessage()
    level, text = describe(plan, 10**15)
    assert level == logging.INFO and "fits" in text


def test_the_run_logs_the_plan_before_anything_loads(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog
) -> None:
    class Stop(Exception):
        pass

    def build_run(cfg):
        raise Stop

    monkeypatch.setattr(runner, "build_run", build_run)
    cfg = compose(["experiment=tiny_sft", f"paths.output_dir={tmp_path / 'run'}"])
    with caplog.at_level(logging.INFO), pytest.raises(Stop):
        runner.train(cfg)
    text = "\n".join(r.getMessage() for r in caplog.records)
    assert "memory plan per device" in text and "weights (fp32)" in text


def test_plan_only_in_process_trains_nothing(tmp_path: Path, caplog) -> None:
    cfg = _grpo_8b("plan_only=true", f"paths.output_dir={tmp_path / 'run'}")
    with caplog.at_level(logging.INFO):
        assert runner.train(cfg) is None
    assert "memory plan per device" in caplog.text
    assert not (tmp_path / "run").exists()


def test_plan_only_logs_the_plan_and_leaves_no_run_folder(tmp_path: Path) -> None:
    run = tmp_path / "run"
    args = ["experiment=grpo_8b", "model=qwen3-8b", "plan_only=true", f"hydra.run.dir={run}"]
    proc = cli([*args, "device_memory_gib=80"])
    out = proc.stdout + proc.stderr
    assert "memory plan per device" in out and "engine KV pool" in out
    assert "device memory 80.00 GiB" in out
    assert not run.exists()
    missing = cli(["experiment=grpo_8b", "plan_only=true", f"hydra.run.dir={run}"], check=False)
    assert missing.returncode != 0 and "model.path" in missing.stderr
    assert not run.exists()


def test_the_docs_table_comes_from_the_plan() -> None:
    from astrai.train.plan_table import markdown_table

    table = markdown_table(["Qwen3-8B (grpo_8b)"])
    assert "| Qwen3-8B (grpo_8b) | 8.19B | FSDP2, chunked head, budget, sleep | - | - |" in table
