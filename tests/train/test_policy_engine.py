"""PolicyEngine (astrai.train.policy_engine): the one owner of a training run's live engine.

Unit: sizes merge to the largest need, a need after the build that the engine cannot meet
is an error naming who asked, `sync` versions only forward and once per step. End to end:
the flagship recipe's shape (tiny_grpo with its evaluation callback) holds one engine and
one KV pool, and with LoRA one set of slot hooks on the live model.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import pytest
from train_helpers import TINY_MODEL, train_run

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
FLAGSHIP = [
    "+experiment=tiny_grpo",
    *TINY_MODEL,
    "tokenizer.train.max_bytes=400000",
    "data.train.prepare.builtin.n=32",
    "data.batch_size=2",
    "strategy.init_from=null",
    "strategy.num_generations=4",
    "strategy.max_new_tokens=8",
    "callbacks.eval.suites.arithmetic.num_prompts=4",
    "callbacks.eval.suites.arithmetic.max_tokens=8",
    "callbacks.eval.every_n_steps=1",
    "callbacks.progress_bar=null",
    "trainer.max_steps=2",
    "debug=fast",
]


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
