"""PolicyEngine (astrai.train.policy_engine): the one owner of a training run's live engine.

Unit: sizes merge to the largest need, a need after the build that the engine cannot meet
is an error naming who asked, `sync` versions only forward and once per step. End to end:
the flagship recipe's shape (tiny_grpo with its evaluation callback) holds one engine and
one KV pool, and with LoRA one set of slot hooks on the live model.
"""

from __future__ import annotations

import functools
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from train_helpers import TINY_GRPO_EVAL, train_run

from astrai.train.policy_engine import PolicyEngine, factory_sizes


class FakeEngine:
    """An engine stand-in: the sizes it was built with, and its weight updates."""

    def __init__(self, model: Any, tokenizer: Any, *, start: bool, **sizes: Any) -> None:
        assert start is False
        self.model, self.sizes = model, sizes
        self.max_seq_len = sizes.get("max_seq_len", 128)
        self.policy_version = 0
        self.updates: list[int] = []
        self.closed = False

    def update_weights(self, fn: Any = None, version: int | None = None) -> int:
        if fn is not None:
            fn()
        self.policy_version = int(version)
        self.updates.append(int(version))
        return self.policy_version

    def shutdown(self) -> None:
        self.closed = True


def owner(factory: Any = FakeEngine) -> PolicyEngine:
    return PolicyEngine(lambda: ("model", "tokenizer"), factory)


def test_sizes_merge_to_the_largest_need_and_the_factorys_own():
    engines = owner(functools.partial(FakeEngine, max_batch_size=16, max_seq_len=64))
    engines.need("eval", max_batch_size=32, max_seq_len=48)
    engines.need("serve", max_batch_size=8)
    assert not engines.built
    engine = engines.engine
    assert engine.sizes == {"max_batch_size": 32, "max_seq_len": 64}
    assert engines.engine is engine and engines.builds == 1  # built once
    assert factory_sizes(FakeEngine) == {}


def test_a_users_factory_serves_when_the_owner_has_none():
    engines = owner(None)
    engines.need("eval", max_seq_len=40, factory=FakeEngine)
    assert isinstance(engines.engine, FakeEngine) and engines.engine.sizes == {"max_seq_len": 40}
    mine = owner(functools.partial(FakeEngine, max_seq_len=64))
    mine.need("eval", factory=lambda *a, **k: pytest.fail("the owner's factory builds"))
    assert mine.engine.max_seq_len == 64


def test_asking_for_more_after_the_build_is_an_error_naming_who():
    engines = owner()
    engines.need("rollouts", max_batch_size=16, max_seq_len=64)
    assert engines.engine.max_seq_len == 64
    engines.need("eval", max_batch_size=16, max_seq_len=32)  # it fits: fine
    with pytest.raises(RuntimeError, match=r"eval needs max_seq_len=65.*already built"):
        engines.need("eval", max_seq_len=65)
    with pytest.raises(RuntimeError, match="serve needs max_batch_size=17"):
        engines.need("serve", max_batch_size=17)


def test_sync_never_goes_back_and_updates_once_per_step():
    engines = owner()
    engine = engines.sync(3)  # built, then brought to step 3
    assert engine.updates == [3]
    assert engines.sync(3) is engine and engine.updates == [3]  # once per step
    engines.sync(2)
    assert engine.policy_version == 3 and engine.updates == [3]  # never backwards
    loaded = []
    engines.sync(4, load=lambda: loaded.append(4))
    assert engine.updates == [3, 4] and loaded == [4]
    engines.close()
    assert engine.closed and not engines.built
    assert engines.sync(4).updates == [4]  # a fresh engine, brought up to the step


# ---------------------------------------------------------------------- the flagship shape
FLAGSHIP = [*TINY_GRPO_EVAL, "callbacks.eval.every_n_steps=1", "trainer.max_steps=2"]


def _counted_run(where: Path, data_dir: Path, extra: list[str], monkeypatch) -> dict[str, Any]:
    """tiny_grpo with evaluation, in this process, counting engines and KV pools built."""
    from astrai.inference import InferenceEngine
    from astrai.inference.cache.pool import PagePool
    from astrai.train.evaluation import EvalCallback

    seen: dict[str, Any] = {"engines": [], "pools": 0, "hooks": []}
    engine_init, pool_init = InferenceEngine.__init__, PagePool.__init__

    def count_engine(self, *a, **k):
        engine_init(self, *a, **k)
        seen["engines"].append(self)

    def count_pool(self, *a, **k):
        pool_init(self, *a, **k)
        seen["pools"] += 1

    evaluate = EvalCallback.evaluate

    def check_hooks(self, trainer, pl_module):  # LoRA: whose slot hooks sit on the live model
        out = evaluate(self, trainer, pl_module)
        engine = pl_module.policy_engine.engine
        if engine.lora_enabled:
            slots = engine.adapters.slots
            seen["hooks"].append(
                all(m.lora is slots.layers[name] for name, m in slots.modules.items())
            )
        return out

    monkeypatch.setattr(InferenceEngine, "__init__", count_engine)
    monkeypatch.setattr(PagePool, "__init__", count_pool)
    monkeypatch.setattr(EvalCallback, "evaluate", check_hooks)
    train_run(where, data_dir, extra, base=FLAGSHIP)
    return seen


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_grpo_with_evaluation_holds_one_engine_and_one_kv_pool(
    tmp_path, data_dir, monkeypatch, lora
):
    extra = ["strategy.lora={r: 4, lora_alpha: 8}"] if lora else []
    seen = _counted_run(tmp_path, data_dir, extra, monkeypatch)
    assert len(seen["engines"]) == 1, seen
    assert seen["pools"] == 1
    if lora:
        assert seen["hooks"] and all(seen["hooks"])  # the one engine's slots on every module


# ---------------------------------------------------------------------- sleep mode
def _rollouts_and_steps(where: Path, data_dir: Path, extra: list[str], monkeypatch) -> dict:
    """tiny_grpo with evaluation in this process: every rollout's token ids, and, from inside
    each optimizer step (a step post-hook: after the update, before any later hook), whether
    the run's engine slept and the KV bytes its pool held."""
    from astrai.inference import InferenceEngine
    from astrai.train.strategies.grpo.module import GRPOModule

    seen: dict[str, Any] = {"engines": [], "rollouts": [], "steps": [], "backward": []}
    engine_init, run_batch = InferenceEngine.__init__, InferenceEngine.run_batch

    def count_engine(self, *a, **k):
        engine_init(self, *a, **k)
        seen["engines"].append(self)

    def record(self, *a, **k):
        out = run_batch(self, *a, **k)
        seen["rollouts"].append([r[0] if isinstance(r, tuple) else r for r in out])
        return out

    def in_step(optimizer, args, kwargs):
        (engine,) = seen["engines"]
        seen["steps"].append((engine.is_sleeping, engine.get_stats()["kv_allocated_bytes"]))

    def probe(self):
        self.trainer.optimizers[0].register_step_post_hook(in_step)

    def in_backward(self, loss):
        (engine,) = seen["engines"]
        seen["backward"].append((engine.is_sleeping, engine.get_stats()["kv_allocated_bytes"]))

    monkeypatch.setattr(InferenceEngine, "__init__", count_engine)
    monkeypatch.setattr(InferenceEngine, "run_batch", record)
    monkeypatch.setattr(GRPOModule, "on_train_start", probe)
    monkeypatch.setattr(GRPOModule, "on_before_backward", in_backward)
    train_run(where, data_dir, ["trainer.max_steps=3", *extra], base=FLAGSHIP)
    seen["pool_bytes"] = seen["engines"][0].pool.storage.nbytes
    return seen


@pytest.mark.parametrize("cache", ["paged", "contiguous"])
def test_a_sleeping_engine_rolls_out_the_same_tokens_and_frees_its_pool_in_the_step(
    tmp_path, data_dir, monkeypatch, cache
):
    """GRPO with evaluation, 3 optimizer steps: with ``enable_sleep_mode`` the engine is asleep
    from each rollout through the backward and the optimizer step with no KV allocated, and every rollout and evaluation is
    token-identical to the same run's without sleep mode."""
    mode = [f"strategy.engine.cache_mode={cache}"]
    awake = _rollouts_and_steps(tmp_path / "awake", data_dir, mode, monkeypatch)
    monkeypatch.undo()
    sleepy = _rollouts_and_steps(
        tmp_path / "sleepy",
        data_dir,
        [*mode, "strategy.engine.enable_sleep_mode=true"],
        monkeypatch,
    )
    size = sum(awake["pool_bytes"])
    assert size > 0 and sum(sleepy["pool_bytes"]) == size
    assert awake["steps"] == [(False, size)] * 3
    assert sleepy["steps"] == [(True, 0)] * 3  # released, by the engine's own accounting
    # and from the rollouts on: the forward and backward have the memory too (TRL's window)
    assert awake["backward"] == [(False, size)] * 3
    assert sleepy["backward"] == [(True, 0)] * 3
    assert len(sleepy["rollouts"]) == len(awake["rollouts"]) >= 6  # rollouts and evaluations
    assert sleepy["rollouts"] == awake["rollouts"]
    (engine,) = sleepy["engines"]
    assert engine.get_stats()["sleep_count"] >= 3  # after each rollout (and evaluation)


def test_a_bad_sleep_setting_is_refused_before_the_run_naming_the_key():
    from astrai.train import preflight
    from astrai.train.runner import compose

    found = preflight.problems(compose([*FLAGSHIP, "strategy.engine.enable_sleep_mode=yes"]))
    assert [p for p in found if p.startswith("strategy.engine.enable_sleep_mode")], found
    found = preflight.problems(compose([*FLAGSHIP, "callbacks.eval.engine.enable_sleep_mode=1"]))
    assert [p for p in found if p.startswith("callbacks.eval.engine.enable_sleep_mode")], found


def test_the_owner_sleeps_only_an_engine_built_for_it():
    class Sleepy(FakeEngine):
        def __init__(self, *a: Any, enable_sleep_mode: bool = True, **k: Any) -> None:
            super().__init__(*a, **k)
            self.sleep_mode = SimpleNamespace(enabled=enable_sleep_mode)
            self.calls: list[str] = []

        def sleep(self, level: int = 1) -> None:
            self.calls.append(f"sleep{level}")

        def wake_up(self) -> None:
            self.calls.append("wake")

    engines = owner(Sleepy)
    engines.sleep()  # not built: nothing
    engine = engines.engine
    engines.sleep()
    engines.sleep()  # once per step
    assert engines.slept is engine and engine.calls == ["sleep1"]
    assert engines.sync(1) is engine and engine.calls == ["sleep1", "wake"]
    assert engines.slept is None
    engines.sleep()
    engines.close()  # closed asleep: a fresh engine sleeps and wakes as the first did
    fresh = engines.engine
    engines.sleep()
    assert fresh is not engine and fresh.calls == ["sleep1"] and engines.slept is fresh
    off = owner(functools.partial(Sleepy, enable_sleep_mode=False))
    built = off.engine
    off.sleep()
    assert built.calls == [] and off.slept is None
