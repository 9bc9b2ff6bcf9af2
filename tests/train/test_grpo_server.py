"""GRPO with ``rollout.mode=server``: rollouts on replica processes (``python -m
astrai.serve allow_weight_updates=true engine.batch_invariant=true``) that receive the
trainer's weights at each policy version. The reference is the colocated run (the trainer's
own batch-invariant engine): rollout tokens, log-probs, advantages, losses and the final
weights equal bit for bit over 5 steps, synchronous and asynchronous, with a replica killed
mid-run, and with multi-turn episodes. Same dtype (fp32) and one torch thread everywhere.
The options are checked before anything loads."""

from __future__ import annotations

import dataclasses
import functools
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from grpo_helpers import make_grpo, prompt_data, prompt_module
from lightning.pytorch.callbacks import Callback
from server_process import free_port, stop, wait_healthy
from train_helpers import quiet_trainer

from astrai.data.rewards import register_reward
from astrai.inference import InferenceEngine
from astrai.model import preset_model, save_pretrained
from astrai.train.environments import Environment, StepResult
from astrai.train.strategies.grpo.rollout_mode import (
    Colocate,
    ServerRollout,
    WeightSync,
    parse_rollout,
)

ROOT = Path(__file__).resolve().parents[2]
LENGTH_REWARD = "test_grpo_server_length"
MAX_SEQ_LEN = 64
STEPS = 5


@register_reward(LENGTH_REWARD)
def _length(record, completion):
    return float(len(completion) % 3)


# both runs on a batch-invariant engine of the same sizes as the replicas'
ENGINE = functools.partial(
    InferenceEngine,
    cache_mode="paged",
    max_batch_size=16,
    max_seq_len=MAX_SEQ_LEN,
    batch_invariant=True,
)
KW = dict(rewards=[LENGTH_REWARD], loss_type="bnpo", kl_coef=0.04, rollout_seed=3, engine=ENGINE)


# ---------------------------------------------------------------------- options
@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ({"mode": "server"}, "strategy.rollout.mode=server needs strategy.rollout.servers"),
        ({"mode": "server", "servers": []}, "needs strategy.rollout.servers"),
        ({"mode": "remote"}, "strategy.rollout.mode must be one of"),
        ({"servers": ["http://a:1"]}, "strategy.rollout.mode=colocate"),
        ({"mode": "server", "servers": ["a:8000"]}, "not an http"),
        ({"mode": "server", "servers": ["http://a:1", "http://a:1"]}, "listed twice"),
        ({"mode": "server", "servers": ["http://a:1"], "timeout": 0}, "rollout.timeout"),
        (
            {"mode": "server", "servers": ["http://a:1"], "sever": 1},
            r"unknown key\(s\) \['sever'\]",
        ),
        (
            {"mode": "server", "servers": ["http://a:1"], "weight_sync": {"backend": "mpi"}},
            "weight_sync.backend must be one of",
        ),
        (
            {"mode": "server", "servers": ["http://a:1"], "weight_sync": {"master_port": -1}},
            "weight_sync.master_port",
        ),
    ],
)
def test_bad_rollout_options_are_named(spec, message):
    with pytest.raises(ValueError, match=message):
        parse_rollout(spec)


def test_rollout_options_parse():
    assert isinstance(parse_rollout(None), Colocate)
    assert isinstance(parse_rollout({"mode": "colocate", "servers": []}), Colocate)
    got = parse_rollout(
        {
            "mode": "server",
            "servers": ["http://a:8000", "http://b:8000"],
            "weight_sync": {"master_address": "10.0.0.1", "master_port": 29600},
        }
    )
    assert got == ServerRollout(
        servers=("http://a:8000", "http://b:8000"),
        weight_sync=WeightSync(master_address="10.0.0.1", master_port=29600),
    )


def test_server_mode_is_refused_before_the_model_loads(monkeypatch):
    from astrai.train.strategies.grpo import GRPOModule

    def no_model(*a, **k):
        raise AssertionError("the model was built")

    with pytest.raises(ValueError, match=r"needs strategy\.rollout\.servers"):
        GRPOModule(model=no_model, tokenizer="unused", rollout={"mode": "server"})


def test_server_mode_with_lora_is_refused_before_the_model_loads():
    from astrai.train.strategies.grpo import GRPOModule

    def no_model(*a, **k):
        raise AssertionError("the model was built")

    with pytest.raises(ValueError, match=r"rollout\.mode=server with strategy\.lora"):
        GRPOModule(
            model=no_model,
            tokenizer="unused",
            lora={"r": 4},
            rollout={"mode": "server", "servers": ["http://127.0.0.1:1"]},
        )


def test_the_issue_spelling_composes(tmp_path):
    from hydra import compose, initialize_config_dir

    from astrai.cli_keys import CONF_DIR, command_line

    args = command_line(
        "train",
        [
            "+experiment=tiny_grpo",
            "rollout.mode=server",
            "rollout.servers=[http://a:8000,http://b:8000]",
            "rollout.weight_sync.master_port=29600",
        ],
    )
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose("train", overrides=args)
    assert cfg.strategy.rollout.mode == "server"
    assert list(cfg.strategy.rollout.servers) == ["http://a:8000", "http://b:8000"]
    assert cfg.strategy.rollout.weight_sync.master_port == 29600
    plain = command_line("train", ["+experiment=tiny_grpo"])
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        default = compose("train", overrides=plain)
    assert default.strategy.rollout.mode == "colocate"


# ---------------------------------------------------------------------- replicas
class Replicas:
    """Replica processes on one model directory; `kill(i)` sends SIGKILL."""

    def __init__(self, model_dir: Path, count: int, threads: int | None = None) -> None:
        self.procs: list[subprocess.Popen] = []
        self.logs: list[Path] = []
        self.urls: list[str] = []
        # the trainer's thread count (default: this process's): batch invariance holds for
        # one thread count only
        threads = threads or torch.get_num_threads()
        env = {**os.environ, "OMP_NUM_THREADS": str(threads), "WANDB_MODE": "offline"}
        for _ in range(count):
            port = free_port()
            log = model_dir.parent / f"replica-{port}.log"
            self.logs.append(log)
            self.procs.append(
                subprocess.Popen(
                    [
                        sys.executable,
                        "-m",
                        "astrai.serve",
                        f"model_path={model_dir}",
                        f"port={port}",
                        "allow_weight_updates=true",
                        f"threads={threads}",
                        "device=cpu",
                        "engine=paged",
                        "engine.batch_invariant=true",
                        "engine.max_batch_size=16",
                        f"engine.max_seq_len={MAX_SEQ_LEN}",
                        "engine.kv_tokens=4096",
                        "log_level=warning",
                    ],
                    cwd=ROOT,
                    env=env,
                    stdout=log.open("w"),
                    stderr=subprocess.STDOUT,
                )
            )
            self.urls.append(f"http://127.0.0.1:{port}")
        for proc, url in zip(self.procs, self.urls):
            wait_healthy(proc, url, timeout=180)

    def kill(self, i: int) -> None:
        self.procs[i].send_signal(signal.SIGKILL)
        self.procs[i].wait(timeout=30)

    def close(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                stop(proc)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """The prompts and tokenizer, and the replicas' model directory: the trainer's model
    config (its initial weights arrive by the first push, like every later version's)."""
    root, tok = prompt_data(tmp_path_factory.mktemp("grpo-server"))
    torch.manual_seed(1)  # other weights than the trainer's: the push must replace them
    save_pretrained(preset_model("tiny", vocab_size=320), root / "policy", tokenizer=tok)
    return root, tok


@pytest.fixture(scope="module")
def replicas(setup):
    root, _ = setup
    made = Replicas(root / "policy", 2)
    yield made
    made.close()


class Trace(Callback):
    """Per micro-step: the generation trained on and the loss."""

    def __init__(self) -> None:
        self.generations: list = []
        self.losses: list[float] = []
        self.val: dict[str, float] = {}

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
        self.generations.append(module.generation)
        self.losses.append(float(outputs["loss"]))


def _fit(root, tok, *, steps=STEPS, stops=False, validate=False, **kw):
    """``validate``: greedy validation on 2 prompts every 2 steps (on the replicas too)."""
    from astrai.data import AstraiDataModule, PromptDataset

    module = make_grpo(root, tok, **{**KW, **kw})
    if stops:  # end a random model's turns early, so that episodes have two turns
        ids = frozenset(range(0, len(tok), 5)) | frozenset(tok.stop_ids)
        module.live_source.params = dataclasses.replace(module.live_source.params, stop_ids=ids)
    trace = Trace()
    data = prompt_module(root)
    val = {}
    if validate:
        prompts = str(root / "prompts.h5")
        data = AstraiDataModule(
            train=PromptDataset(prompts), val=PromptDataset(prompts), batch_size=2, seed=0
        )
        val = dict(limit_val_batches=1, val_check_interval=2, num_sanity_val_steps=0)
    trainer = quiet_trainer(
        max_steps=steps,
        callbacks=[trace],
        use_distributed_sampler=False,
        **(val or dict(limit_val_batches=0)),
    )
    trainer.fit(module, datamodule=data)
    trace.val = {k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("val/")}
    weights = {k: v.detach().clone() for k, v in module.model.state_dict().items()}
    return weights, trace, module


def _rows(trace: Trace) -> list[tuple]:
    return [
        (g.prompts, g.completions, g.logprobs, g.truncated, g.advantages, g.action_masks)
        for g in trace.generations
    ]


def _assert_equal_runs(colocated, server) -> None:
    (w_a, t_a, _), (w_b, t_b, _) = colocated, server
    assert len(t_a.generations) == len(t_b.generations) > 1
    assert _rows(t_a) == _rows(t_b)  # tokens, log-probs (float ==), advantages
    rewards = [g.metrics["reward_mean"] for g in t_a.generations]
    assert rewards == [g.metrics["reward_mean"] for g in t_b.generations]
    assert len(set(rewards)) > 1, "the rewards vary: the comparison can fail"
    assert t_a.losses == t_b.losses
    assert w_a.keys() == w_b.keys()
    for k in w_a:
        assert torch.equal(w_a[k], w_b[k]), k


def _server(replicas: Replicas) -> dict:
    return {"mode": "server", "servers": replicas.urls}


@pytest.mark.slow
def test_server_mode_equals_colocated(setup, replicas):
    root, tok = setup
    colocated = _fit(root, tok)
    server = _fit(root, tok, rollout=_server(replicas))
    _assert_equal_runs(colocated, server)
    pool = server[2].rollout_engine.pool
    assert pool.policy_version == STEPS - 1  # the weights of the last rollout's step
    assert len(pool.live) == 2


@pytest.mark.slow
def test_async_server_mode_equals_async_colocated(setup, replicas):
    """The server run also validates every 2 steps on the replicas: validation pushes the
    live weights between the generator's jobs, the generator's next job pushes its
    snapshot again, and nothing of the training changes. (The colocated run validates
    not: there the trainer's engine, built by validation on the live policy, changes the
    last bits of the no-gradient forward that corrects stale samples.)"""
    root, tok = setup
    spec = {"max_staleness": 1}
    colocated = _fit(root, tok, async_rollouts=spec)
    server = _fit(root, tok, async_rollouts=spec, rollout=_server(replicas), validate=True)
    _assert_equal_runs(colocated, server)
    assert "val/reward" in server[1].val
    stale = [g.versions for g in server[1].generations]
    assert any(v is not None and min(v) < i for i, v in enumerate(stale)), "sampled ahead"


class TwoTurns(Environment):
    """Turn 1 hears "check it" (reward 0.25); turn 2 ends the episode."""

    def __init__(self) -> None:
        self.turn = 0

    def reset(self, record):
        return [{"role": "user", "content": record["prompt"]}]

    def step(self, messages):
        self.turn += 1
        if self.turn == 1:
            return StepResult([{"role": "user", "content": "check it"}], 0.25, False)
        return StepResult(None, 0.0, True)


@pytest.mark.slow
def test_multi_turn_server_mode_equals_colocated(setup, replicas):
    root, tok = setup
    kw = dict(environment=TwoTurns, max_turns=3, stops=True, steps=2)
    colocated = _fit(root, tok, **kw)
    server = _fit(root, tok, rollout=_server(replicas), **kw)
    _assert_equal_runs(colocated, server)
    masks = [m for g in server[1].generations for m in g.action_masks]
    assert any(0 in m for m in masks), "some episodes had a second turn"


@pytest.mark.slow
def test_a_replica_killed_mid_run_changes_nothing(setup):
    """Replica 0 is killed (SIGKILL) right after the push of step 2's weights: its groups
    of that step fail to connect and go to replica 1; step 3's push finds it gone and forms
    the weight group again without it."""
    root, tok = setup
    colocated = _fit(root, tok)
    fresh = Replicas(root / "policy", 2)
    try:
        module_box: list = []

        class KillAfterPush(Callback):
            def on_train_batch_start(self, trainer, module, batch, batch_idx) -> None:
                if batch_idx != 2:
                    return
                channel = module.rollout_engine.channel
                push = channel.push

                def push_then_kill(named):
                    out = push(named)
                    fresh.kill(0)
                    channel.push = push
                    return out

                channel.push = push_then_kill
                module_box.append(module)

        module = make_grpo(root, tok, **KW, rollout=_server(fresh))
        trace = Trace()
        trainer = quiet_trainer(
            max_steps=STEPS,
            callbacks=[trace, KillAfterPush()],
            limit_val_batches=0,
            use_distributed_sampler=False,
        )
        trainer.fit(module, datamodule=prompt_module(root))
        weights = {k: v.detach().clone() for k, v in module.model.state_dict().items()}
        assert fresh.procs[0].poll() is not None, "replica 0 was killed"
        assert [c.url for c in module.rollout_engine.pool.live] == [fresh.urls[1]]
        _assert_equal_runs(colocated, (weights, trace, module))
    finally:
        fresh.close()


# ---------------------------------------------------------------------- the 8B recipe
def test_grpo_8b_server_composes_and_plans(tmp_path, caplog):
    """experiment=grpo_8b_server: grpo_8b's trainer on 4 FSDP2 devices, its rollouts on 2
    replicas over NCCL; its trainer-side plan runs (plan_only) without a replica."""
    import logging

    from astrai.train import runner
    from astrai.train.runner import compose

    base = compose(["experiment=grpo_8b", "model=qwen3-8b"])
    cfg = compose(["experiment=grpo_8b_server", "model=qwen3-8b"])
    assert cfg.trainer.devices == 4 and cfg.trainer.strategy._target_.endswith("FullyShardStrategy")
    rollout = parse_rollout(dict(cfg.strategy.rollout))
    assert isinstance(rollout, ServerRollout) and len(rollout.servers) == 2
    assert rollout.weight_sync.backend == "nccl"
    per_step = cfg.trainer.devices * cfg.trainer.accumulate_grad_batches * cfg.data.batch_size
    assert per_step == base.trainer.devices * base.trainer.accumulate_grad_batches
    assert cfg.strategy.engine.max_seq_len == base.strategy.engine.max_seq_len
    out = f"paths.output_dir={tmp_path / 'run'}"
    planned = compose(["experiment=grpo_8b_server", "model=qwen3-8b", "plan_only=true", out])
    with caplog.at_level(logging.INFO):
        assert runner.train(planned) is None
    assert "memory plan per device" in caplog.text
    assert not (tmp_path / "run").exists()


# ---------------------------------------------------------------------- 2 ranks, FSDP2
@pytest.mark.slow
def test_server_mode_on_two_fsdp2_ranks_equals_colocated(tmp_path, data_dir):
    """`python -m astrai.train` on 2 FSDP2 processes: rank 0 pushes the weights gathered
    from the shards, both ranks send their groups to the replicas; losses, each rank's
    rollouts and the exported weights equal the colocated run's."""
    import json

    from grpo_helpers import TINY_GRPO_CLI
    from safetensors.torch import load_file
    from train_helpers import cli, run_dirs

    env = {"PYTHONPATH": str(Path(__file__).resolve().parent)}
    args = [
        *TINY_GRPO_CLI,
        "trainer=fsdp2",
        "trainer.accelerator=cpu",
        "trainer.devices=2",
        "data.batch_size=2",
        "trainer.max_steps=4",
        "strategy.engine.batch_invariant=true",
        f"strategy.engine.max_seq_len={MAX_SEQ_LEN}",
    ]

    def run(where: Path, *extra: str) -> Path:
        record = [
            "+callbacks.rec._target_=_rl_callbacks.StepRecord",
            f"+callbacks.rec.path={where}",
        ]
        cli([*args, *extra, *record, *run_dirs(where, data_dir)], env=env, timeout=600)
        return where

    colocated = run(tmp_path / "colocated")
    # the run's config and tokenizer; the CLI's thread count (train_helpers.cli)
    replicas = Replicas(colocated / "run" / "export", 2, int(os.environ.get("OMP_NUM_THREADS", 1)))
    try:
        server = run(
            tmp_path / "server",
            "rollout.mode=server",
            f"rollout.servers=[{','.join(replicas.urls)}]",
        )
    finally:
        replicas.close()

    def lines(path: Path) -> list[dict]:
        return [json.loads(line) for line in path.read_text().splitlines()]

    a, b = lines(colocated / "steps.jsonl"), lines(server / "steps.jsonl")
    assert [r["step"] for r in a] == [1, 2, 3, 4] and a == b  # losses to the bit
    for rank in (0, 1):
        assert lines(colocated / f"rollouts.rank{rank}.jsonl") == lines(
            server / f"rollouts.rank{rank}.jsonl"
        )
    pushes = (server / "run" / "__main__.log").read_text().count("weights pushed to 2 replica(s)")
    assert pushes == 2, "one push per generation batch (num_iterations 2), from rank 0"
    wa = load_file(colocated / "run" / "export" / "model.safetensors")
    wb = load_file(server / "run" / "export" / "model.safetensors")
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
