"""DAPO's dynamic sampling (astrai.train.strategies.grpo.dynamic_sampling, verl's
``algorithm.filter_groups``): no zero-variance group below the cap, ``fill`` / ``raise`` at
it, the queued groups through a checkpoint, resume and ``astrai.train.replay`` bit for bit."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import zlib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest
import torch
from grpo_helpers import TINY_GRPO_CLI, make_grpo, prompt_data, prompt_module
from lightning.pytorch.callbacks import Callback
from torch.utils.data import DataLoader
from train_helpers import REPO, checkpoint_differences, cli, quiet_trainer, run_dirs

from astrai.data.datasets import collate_prompt
from astrai.data.rewards import register_reward
from astrai.train.strategies.grpo.dynamic_sampling import (
    CHECKPOINT_KEY,
    DynamicSampling,
    DynamicSamplingSource,
    draw_prompts,
    extra_seed,
)
from astrai.train.strategies.grpo.options import GRPOOptions
from astrai.train.strategies.grpo.sampling import Samples
from astrai.train.strategies.grpo.source import RecordingSource, RolloutSource

G = 4
HERE = Path(__file__).resolve().parent
ENV = {"PYTHONPATH": str(HERE)}  # _callbacks (KillAtStep) and this module's reward


def rank_split_reward(record: Mapping[str, Any], completion: str) -> float:
    """Flat on rank 1, varying (a hash of the completion) on rank 0: only rank 1 falls short."""
    if torch.distributed.is_initialized() and torch.distributed.get_rank() == 1:
        return 0.0
    return float(zlib.crc32(completion.encode()) % 97)


def sparse_reward(record: Mapping[str, Any], completion: str) -> float:
    """Varies for a random policy on prompts whose answer is even, never on the others: about
    half the groups have zero variance (a `_target_` reward of the CLI runs)."""
    if int(str(record["answer"]).strip()) % 2:
        return 0.0
    return float(len(completion) % 3)


SPARSE = "test_grpo_dynamic_sampling_sparse"
register_reward(SPARSE)(sparse_reward)


# ------------------------------------------------------------------ a canned source
def _flat(prompt: list[int]) -> bool:
    """The canned source's rule: a prompt starting with an odd token gives equal rewards."""
    return prompt[0] % 2 == 1


class Canned(RolloutSource):
    """G completions per prompt; completion j of prompt p rewards ``j % 2`` (varies) unless
    :func:`_flat` (all 1.0); column ``other`` is the opposite (varies exactly where the
    total does not)."""

    def __init__(self) -> None:
        self.calls: list[tuple[int, list[list[int]]]] = []

    def take(self, batch, seed, step):
        prompts = [list(p) for p in batch["prompt_ids"]]
        self.calls.append((seed, prompts))
        self.waited = 0.5
        rewards, other = [], []
        for p in prompts:
            rewards += [1.0] * G if _flat(p) else [float(j % 2) for j in range(G)]
            other += [float(j) for j in range(G)] if _flat(p) else [2.0] * G
        n = len(rewards)
        return Samples(
            prompts=[prompts[i // G] for i in range(n)],
            completions=[[seed % 97, i] for i in range(n)],
            logprobs=[[-0.1, -0.2]] * n,
            truncated=[False] * n,
            rewards=rewards,
            parts={"main": sum(rewards) / n},
            stats={"episode/turns": 1.0},
            version=step,
            reward_columns={"main": list(rewards), "other": other},
        )


def _pool(size: int = 40) -> DataLoader:
    """A training loader of `size` one-token prompts (token = index, so half are flat)."""
    items = [
        {"prompt_ids": torch.tensor([i + 2, 1]), "record": {"answer": str(i)}} for i in range(size)
    ]
    return DataLoader(items, batch_size=2, collate_fn=collate_prompt)


def _source(**spec: Any) -> tuple[DynamicSamplingSource, Canned]:
    inner, loader = Canned(), _pool()
    options = DynamicSampling(**spec)
    return DynamicSamplingSource(inner, options, G, lambda s, n: draw_prompts(loader, s, n)), inner


def _batch(*firsts: int) -> dict[str, Any]:
    return {"prompt_ids": [[f, 1] for f in firsts], "records": [{}] * len(firsts)}


def _groups(samples: Samples) -> list[list[float]]:
    return [samples.rewards[i : i + G] for i in range(0, len(samples.rewards), G)]


def _reference_take(calls, queue: list[list[int]], need: int) -> tuple[list, list]:
    """What verl's filter keeps, written from its definition over the canned source's calls:
    per generated group in order, kept when its metric's std is > 0; queued groups first;
    the first `need` are the batch, the rest the queue."""
    kept = list(queue)
    for _, prompts in calls:
        kept += [p for p in prompts if not _flat(p)]
    return kept[:need], kept[need:]


def test_no_zero_variance_group_below_the_cap():
    source, inner = _source(max_num_gen_batches=0)
    queue: list[list[int]] = []
    saw_extra = saw_queue = False
    for step, batch in enumerate([_batch(3, 5), _batch(2, 3), _batch(5, 7), _batch(4, 6)]):
        inner.calls.clear()
        out = source.take(batch, 1000 + step, step)
        assert len(out.completions) == 2 * G
        assert all(len(set(g)) > 1 for g in _groups(out))  # never a zero-variance group
        expected, queue = _reference_take(inner.calls, queue, 2)
        assert [out.prompts[i] for i in range(0, 2 * G, G)] == expected
        assert [g.prompts[0] for g in source.queue] == queue
        # the loader batch is sampled first, with its own seed; extra ones with derived seeds
        assert inner.calls[0] == (1000 + step, batch["prompt_ids"])
        seeds = [extra_seed(1000 + step, k) for k in range(1, len(inner.calls))]
        assert [s for s, _ in inner.calls[1:]] == seeds
        generated = [p for _, ps in inner.calls for p in ps]
        before = sum(_flat(p) for p in generated) / len(generated)
        assert out.stats["dynamic_sampling/zero_var_frac_before"] == before
        assert out.stats["dynamic_sampling/gen_batches"] == len(inner.calls)
        assert out.stats["dynamic_sampling/hit_cap"] == 0.0
        assert out.stats["episode/turns"] == 1.0  # the loader batch's own stats kept
        assert source.waited == 0.5 * len(inner.calls)
        assert out.parts["main"] == sum(out.rewards) / len(out.rewards)
        assert out.reward_columns["main"] == out.rewards
        saw_extra |= len(inner.calls) > 1
        saw_queue |= bool(queue)
    assert saw_extra and saw_queue


def test_the_metric_may_be_one_rewards_column():
    """metric=other: the groups kept are those whose `other` column varies (the flat total)."""
    source, _ = _source(metric="other")
    out = source.take(_batch(3, 4), 7, 0)
    groups = [out.reward_columns["other"][i : i + G] for i in range(0, 2 * G, G)]
    assert all(len(set(g)) > 1 for g in groups)
    assert all(_flat(out.prompts[i]) for i in range(0, 2 * G, G))


def test_fill_at_the_cap_tops_up_with_zero_variance_groups():
    source, inner = _source(max_num_gen_batches=1, at_cap="fill")
    out = source.take(_batch(3, 4, 5), 11, 0)
    assert len(inner.calls) == 1 and out.stats["dynamic_sampling/hit_cap"] == 1.0
    # the varying group first, then the zero-variance ones in generation order
    assert [out.prompts[i][0] for i in range(0, 3 * G, G)] == [4, 3, 5]
    assert out.stats["dynamic_sampling/zero_var_frac_before"] == 2 / 3
    assert source.queue == []


def test_raise_at_the_cap_stops_with_verls_error():
    source, inner = _source(max_num_gen_batches=2, at_cap="raise")
    loader = _pool(3)  # extra prompts 2, 3, 4: not enough varying groups for 3
    source.draw = lambda s, n: draw_prompts(loader, s, n)
    with pytest.raises(RuntimeError, match=r"max_num_gen_batches=2 .*Generated too many"):
        source.take(_batch(3, 5, 7), 11, 0)
    assert len(inner.calls) == 2


def test_the_queue_travels_in_the_checkpoint():
    """A wrapper restored from another's state takes what the other would have taken."""
    a, _ = _source()
    step = 0
    while not a.queue:  # extra batches until 2 groups vary; more may be queued
        step += 1
        a.take(_batch(3, 5), 20 + step, step)
    state = a.state_dict()
    assert len(state[CHECKPOINT_KEY]) == 1 and state[CHECKPOINT_KEY][0]
    b, _ = _source()
    b.load_state_dict(json.loads(json.dumps(state)))  # plain data
    x, y = a.take(_batch(2, 3), 99, step + 1), b.take(_batch(2, 3), 99, step + 1)
    assert x == y and x.version == step  # the queued group's sampler
    with pytest.raises(RuntimeError, match="resumes at 1 rank"):
        c, _ = _source()
        c.rank = lambda: (0, 2)
        c.load_state_dict(state)


def test_extra_prompts_are_drawn_deterministically_from_the_loader():
    loader = _pool(10)
    one, two = draw_prompts(loader, 5, 4), draw_prompts(loader, 5, 4)
    assert one["prompt_ids"] == two["prompt_ids"] and len(set(map(tuple, one["prompt_ids"]))) == 4
    assert one["records"] == [{"answer": str(p[0] - 2)} for p in one["prompt_ids"]]
    assert draw_prompts(loader, 6, 4)["prompt_ids"] != one["prompt_ids"]
    assert extra_seed(5, 1) == extra_seed(5, 1) != extra_seed(5, 2)
    state = torch.get_rng_state()
    draw_prompts(loader, 7, 3)
    assert torch.equal(state, torch.get_rng_state())  # the training stream is untouched


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ({"metric": "nope"}, "dynamic_sampling.metric must be one of"),
        ({"max_num_gen_batches": -1}, "dynamic_sampling.max_num_gen_batches must be an int"),
        ({"at_cap": "skip"}, "dynamic_sampling.at_cap must be one of"),
        ({"enable": True}, "dynamic_sampling: unknown key"),
        ([1], "dynamic_sampling must be a mapping"),
    ],
)
def test_bad_settings_are_refused_naming_the_key(spec, message):
    with pytest.raises(ValueError, match=message):
        GRPOOptions.parse(rewards=["exact_match", "format"], dynamic_sampling=spec)


def test_settings_parse_and_refuse_async_rollouts():
    o = GRPOOptions.parse(rewards=["exact_match", "format"], dynamic_sampling={"metric": "format"})
    assert o.dynamic_sampling == DynamicSampling("format", 0, "fill")
    assert GRPOOptions.parse(dynamic_sampling=None).dynamic_sampling is None
    with pytest.raises(ValueError, match=r"dynamic_sampling with strategy\.async_rollouts"):
        GRPOOptions.parse(dynamic_sampling={}, async_rollouts={"max_staleness": 1})


# ------------------------------------------------------------------ a tiny model, in process
@pytest.fixture(scope="module")
def prompt_setup(tmp_path_factory):
    return prompt_data(tmp_path_factory.mktemp("grpo-dynsamp"))


STEPS = 10
DYNAMIC = dict(
    rewards=[SPARSE],
    dynamic_sampling={"metric": "reward", "max_num_gen_batches": 0, "at_cap": "fill"},
    num_iterations=2,
)


def _fit(root, tok, where: Path, *, ckpt_path=None, heard=None):
    from lightning.pytorch.callbacks import ModelCheckpoint

    module = make_grpo(root, tok, **DYNAMIC)
    if heard is not None:
        module.wrap_source(lambda s: RecordingSource(s, lambda seed, x: heard.append(x)))
    ckpt = ModelCheckpoint(dirpath=where, filename="s{step}", every_n_train_steps=1, save_top_k=-1)
    trainer = quiet_trainer(
        default_root_dir=where,
        max_steps=STEPS,
        callbacks=[ckpt],
        enable_checkpointing=True,
        limit_val_batches=0,
        use_distributed_sampler=False,
    )
    trainer.fit(module, datamodule=prompt_module(root, batch_size=3), ckpt_path=ckpt_path)
    return {k: v.clone() for k, v in module.state_dict().items()}


def test_a_tiny_run_trains_on_varying_groups_and_resumes_exactly(prompt_setup, tmp_path):
    """Ten steps (mu = 2: five takes of 3 prompts) with a reward flat on about half the prompts: every
    batch's groups vary; resumed from every checkpoint (between the two passes, between two
    takes, with groups queued), the run ends where the uninterrupted one does, bit for bit."""
    root, tok = prompt_setup
    heard: list[Samples] = []
    final = _fit(root, tok, tmp_path / "ref", heard=heard)
    assert len(heard) == STEPS // 2
    for samples in heard:
        groups = _groups(samples)
        assert len(groups) == 3 and all(len(set(g)) > 1 for g in groups)
        assert samples.stats["dynamic_sampling/hit_cap"] == 0.0
    assert any(s.stats["dynamic_sampling/gen_batches"] > 1 for s in heard)
    assert any(s.stats["dynamic_sampling/zero_var_frac_before"] > 0 for s in heard)
    saved = {p.name: torch.load(p, weights_only=False) for p in (tmp_path / "ref").glob("*.ckpt")}
    queued = [name for name, c in saved.items() if c[CHECKPOINT_KEY][0]]
    assert queued, "no checkpoint with queued groups: the resume below would not cover them"
    for name in sorted(saved):
        if name.startswith("s") and f"step={STEPS}" not in name:
            resumed = _fit(root, tok, tmp_path / name, ckpt_path=tmp_path / "ref" / name)
            different = [k for k, v in final.items() if not torch.equal(resumed[k], v)]
            assert not different, f"resumed from {name}: {different}"


# ------------------------------------------------------------------ the CLI: kill, replay
CLI_RUN = [
    *TINY_GRPO_CLI,
    "data.batch_size=2",
    "strategy.rewards=[{_target_: test_grpo_dynamic_sampling.sparse_reward, _partial_: true}]",
    "strategy.dynamic_sampling={metric: reward, max_num_gen_batches: 8, at_cap: fill}",
    "callbacks.model_checkpoint.every_n_train_steps=1",
    "callbacks.model_checkpoint.save_top_k=-1",
    "trainer.max_steps=6",
    "ledger=true",
]


def _replay(run: Path, *args: str, out: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "astrai.train.replay", str(run), *args, f"out={out}"],
        cwd=REPO,
        env={**os.environ, "WANDB_MODE": "offline", **ENV},
        capture_output=True,
        text=True,
        timeout=600,
    )


@pytest.mark.slow
def test_kill_with_groups_queued_resumes_and_replays_bit_exact(tmp_path, data_dir):
    """Through `python -m astrai.train`: killed in the step after a checkpoint that holds
    queued groups and resumed with ckpt_path=last, the run ends with the uninterrupted one's
    weights and optimizer state, bit for bit; `astrai.train.replay` of the recorded steps
    reproduces the ledger exactly, from the final samples it recorded."""
    cli([*CLI_RUN, *run_dirs(tmp_path / "ref", data_dir)], env=ENV)
    ref = tmp_path / "ref" / "run"
    ckpts = {
        s: torch.load(ref / "checkpoints" / f"step{s:06d}.ckpt", weights_only=False)
        for s in range(1, 6)
    }
    queued = [s for s, c in ckpts.items() if c[CHECKPOINT_KEY][0]]
    assert queued, "no checkpoint with queued groups"
    step = queued[0]
    where = tmp_path / "kill"
    args = [*CLI_RUN, *run_dirs(where, data_dir)]
    kill = ["+callbacks.kill._target_=_callbacks.KillAtStep", f"+callbacks.kill.step={step}"]
    killed = cli([*args, *kill], check=False, env=ENV)
    assert killed.returncode == -9, killed.stderr[-3000:]
    cli([*args, "ckpt_path=last"], env=ENV)
    different = checkpoint_differences(ref, where / "run", 6)
    assert not different, f"killed in step {step + 1}: {different}"

    out = tmp_path / "replay.json"
    proc = _replay(ref, "step=2", "--until", "6", out=out)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    checks = json.loads(out.read_text())
    assert [(c["step"], c["ok"]) for c in checks] == [(s, True) for s in range(2, 7)]


# ------------------------------------------------------------------ two DDP ranks
class RankStats(Callback):
    """Each rank's generation metrics after every micro-step, one JSON line per step in
    `<path>/rank<r>.jsonl` (a `+callbacks` entry of the DDP runs)."""

    def __init__(self, path: str) -> None:
        self.path = Path(path)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.path.mkdir(parents=True, exist_ok=True)
        with open(self.path / f"rank{trainer.global_rank}.jsonl", "a") as f:
            f.write(json.dumps(pl_module.generation.metrics) + "\n")


DDP = ["trainer=ddp", "trainer.accelerator=cpu", "trainer.devices=2", "ledger=false"]


@pytest.mark.slow
def test_ddp_ranks_fill_their_own_batches_and_resume_exactly(tmp_path, data_dir):
    """Two gloo processes: each rank fills its own batch with its own number of generation
    batches (nothing waits on the other rank meanwhile); the checkpoint holds both ranks'
    queues; killed after a checkpoint with groups queued and resumed, the run ends bit for
    bit where the uninterrupted one does."""
    stats = tmp_path / "stats"
    record = ["+callbacks.ranks._target_=test_grpo_dynamic_sampling.RankStats"]
    cli(
        [
            *CLI_RUN,
            *DDP,
            *run_dirs(tmp_path / "ref", data_dir),
            *record,
            f"+callbacks.ranks.path={stats}",
        ],
        env=ENV,
    )
    per_rank = [
        [json.loads(line) for line in (stats / f"rank{r}.jsonl").read_text().splitlines()]
        for r in (0, 1)
    ]
    batches = [[m["dynamic_sampling/gen_batches"] for m in rows] for rows in per_rank]
    assert batches[0] != batches[1], batches  # the ranks sampled differently, and finished
    assert all(m["zero_var_frac"] == 0.0 for rows in per_rank for m in rows)  # no cap hit
    ref = tmp_path / "ref" / "run"
    ckpts = {
        s: torch.load(ref / "checkpoints" / f"step{s:06d}.ckpt", weights_only=False)
        for s in range(1, 6)
    }
    assert all(len(c[CHECKPOINT_KEY]) == 2 for c in ckpts.values())
    queued = [s for s, c in ckpts.items() if any(c[CHECKPOINT_KEY])]
    assert queued, "no checkpoint with queued groups"
    where = tmp_path / "kill"
    args = [*CLI_RUN, *DDP, *run_dirs(where, data_dir)]
    kill = ["+callbacks.kill._target_=_callbacks.KillAtStep", f"+callbacks.kill.step={queued[0]}"]
    killed = cli([*args, *kill], check=False, env=ENV)
    assert killed.returncode != 0, killed.stderr[-3000:]
    cli([*args, "ckpt_path=last"], env=ENV)
    different = checkpoint_differences(ref, where / "run", 6)
    assert not different, f"killed in step {queued[0] + 1}: {different}"


@pytest.mark.slow
def test_ddp_raise_at_the_cap_stops_every_rank(tmp_path, data_dir):
    """at_cap=raise with max_num_gen_batches=1 and a reward flat on rank 1 only: rank 1 is
    short, rank 0 is not; both stop with the error (the ranks agree on the stop once per
    take), rank 0 not left to fail later on a lost peer, or to wait for it."""
    spec = "strategy.dynamic_sampling={metric: reward, max_num_gen_batches: 1, at_cap: raise}"
    reward = "strategy.rewards=[{_target_: test_grpo_dynamic_sampling.rank_split_reward, _partial_: true}]"
    replaced = {"strategy.dynamic_sampling=": spec, "strategy.rewards=": reward}
    args = [next((v for k, v in replaced.items() if a.startswith(k)), a) for a in CLI_RUN]
    proc = cli([*args, *DDP, *run_dirs(tmp_path, data_dir)], check=False, env=ENV, timeout=300)
    assert proc.returncode != 0
    assert "max_num_gen_batches=1 generation batches reached" in proc.stderr
    assert "this rank: 0 of 2" in proc.stderr  # rank 1's own message
    assert "this rank: enough of 2" in proc.stderr  # rank 0 stops with it too
    assert not (tmp_path / "run" / "checkpoints" / "step000001.ckpt").exists()
