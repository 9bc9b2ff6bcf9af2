"""The live inference engine of a training run, with one owner.

GRPO's rollouts, the evaluation callback and the live policy server all generate with the
policy's *live* weights. They share one :class:`~astrai.inference.InferenceEngine` (one KV
pool, one set of LoRA slot hooks on the model), held by the module's :class:`PolicyEngine`
(``LMModule.policy_engine``). Each user declares what it needs (:meth:`PolicyEngine.need`:
``max_batch_size``, ``max_seq_len``) before the first use; the engine is built once, lazily,
at the largest size anyone asked for. After the build a larger need is a configuration error,
never a silent second engine. :meth:`PolicyEngine.sync` is the one versioned weight path:
the engine's policy version follows the optimizer step and never goes back. What the engine
runs on is :attr:`PolicyEngine.weights` (:mod:`astrai.train.engine_weights`): the live model
(DDP, one process) or, under FSDP2, a full copy gathered from the shards per policy version,
a collective in which ranks that do not use the engine take part through
:meth:`PolicyEngine.join`.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from astrai.train.engine_weights import EngineWeights, LiveWeights

if TYPE_CHECKING:
    from astrai.inference import InferenceEngine

log = logging.getLogger(__name__)

EngineFactory = Callable[..., "InferenceEngine"]
SIZES = ("max_batch_size", "max_seq_len")


@dataclass(frozen=True)
class EngineNeed:
    """What one user of the engine needs (None: no opinion)."""

    who: str
    max_batch_size: int | None = None
    max_seq_len: int | None = None

    def size(self, name: str) -> int | None:
        return self.max_batch_size if name == "max_batch_size" else self.max_seq_len


def factory_sizes(factory: EngineFactory | None) -> dict[str, int]:
    """The sizes a factory fixes itself (a Hydra ``_partial_`` engine group: its keywords)."""
    if not isinstance(factory, functools.partial):
        return {}
    return {k: int(v) for k, v in factory.keywords.items() if k in SIZES and v is not None}


class PolicyEngine:
    """The one engine on ``model`` (built on first use of :attr:`engine`).

    Args:
        live: returns ``(model, tokenizer)``, the live policy, read at the build.
        factory: the engine factory, called as ``factory(model, tokenizer, start=False,
            **sizes)``; None: the first factory a user declares, else ``InferenceEngine``.
        weights: what the engine runs on (:meth:`use_weights`); None: the live model.
    """

    def __init__(
        self,
        live: Callable[[], tuple[Any, Any]],
        factory: EngineFactory | None = None,
        weights: EngineWeights | None = None,
    ) -> None:
        self.live = live
        self.factory = factory
        self.weights: EngineWeights = weights or LiveWeights()
        self.needs: list[EngineNeed] = []
        self.sizes: dict[str, int] = {}  # what the engine was built with
        self._engine: InferenceEngine | None = None
        self.builds = 0  # engines built over this owner's life (one per fit)
        self.slept: InferenceEngine | None = None  # the engine `sleep` put to sleep

    @property
    def built(self) -> bool:
        return self._engine is not None

    def use_weights(self, weights: EngineWeights) -> None:
        """Choose what the engine runs on (the strategy's set-up), before it is built."""
        if self.built:
            raise RuntimeError("PolicyEngine.use_weights: the engine is already built")
        self.weights = weights

    def need(
        self,
        who: str,
        *,
        max_batch_size: int | None = None,
        max_seq_len: int | None = None,
        factory: EngineFactory | None = None,
    ) -> None:
        """Declare ``who``'s needs. Before the build they are merged (the largest of each
        size); after it, more than the engine has is an error naming who asked."""
        want = EngineNeed(who, max_batch_size, max_seq_len)
        if self.factory is None and factory is not None and not self.built:
            self.factory = factory
        if not self.built:
            self.needs = [n for n in self.needs if n.who != who] + [want]
            return
        for name in SIZES:
            asked, has = want.size(name), self.sizes.get(name)
            if asked is not None and (has is None or asked > has):
                raise RuntimeError(
                    f"PolicyEngine: {who} needs {name}={asked} but the run's engine was already "
                    f"built with {name}={has if has is not None else 'its factory default'}; "
                    "declare engine needs before the first use (e.g. in the callback's setup)"
                )

    # ------------------------------------------------------------------ sleep
    def sleep(self) -> None:
        """Put the built engine to sleep (level 1: KV pool, packs, decode graphs freed) when
        it was built with ``enable_sleep_mode``; else, or when not built, nothing. Called
        after GRPO's rollouts (``GRPOModule.rollout``: TRL's ``vllm_enable_sleep_mode``
        window, so the forward, the backward and the optimizer step have the memory) and
        before every optimizer step (``LMModule.on_before_optimizer_step``); every use of
        :attr:`engine` (and :meth:`sync`) wakes it first (:meth:`wake_up`), GRPO's version
        bump (:meth:`join`) does not."""
        engine = self._engine
        if engine is None or self.slept is engine or not engine.sleep_mode.enabled:
            return
        engine.sleep(level=1)
        self.slept = engine
        log.debug("policy engine asleep for the optimizer step")

    @property
    def asleep(self) -> bool:
        """The engine is built and :meth:`sleep` put it to sleep."""
        return self.slept is not None and self.slept is self._engine

    def wake_up(self) -> None:
        """Wake the engine :meth:`sleep` put to sleep (its pool and packs taken back, packs
        from the current weights); awake, or closed since: nothing."""
        if self.slept is not None and self.slept is self._engine:
            self.slept.wake_up()
            log.debug("policy engine awake")
        self.slept = None

    def merged_sizes(self) -> dict[str, int]:
        """The largest size of each kind any user (or the factory itself) asked for."""
        sizes = dict(factory_sizes(self.factory))
        for n in self.needs:
            for name in SIZES:
                value = n.size(name)
                if value is not None:
                    sizes[name] = max(sizes.get(name, 0), int(value))
        return sizes

    @property
    def engine(self) -> InferenceEngine:
        """The engine on the live weights (built at the first call)."""
        if self._engine is None:
            live, tokenizer = self.live()
            model = self.weights.engine_model(live)
            factory = self.factory
            if factory is None:
                from astrai.inference import InferenceEngine

                factory = InferenceEngine
            self.sizes = self.merged_sizes()
            self._engine = factory(model, tokenizer, start=False, **self.sizes)
            self.sizes["max_seq_len"] = int(self._engine.max_seq_len)
            self.builds += 1
            log.info(
                "policy engine built for %s: %s",
                ", ".join(n.who for n in self.needs) or "the module",
                self.sizes,
            )
        self.wake_up()
        return self._engine

    def sync(self, step: int, load: Callable[[], Any] | None = None) -> InferenceEngine:
        """The engine, awake, with its policy version brought up to ``step`` (``load`` copies
        new weights in first, where the engine's model is a copy the caller keeps; by
        default :attr:`weights` refresh it); never backwards, so a second call at the same
        step changes nothing. Under FSDP2 every rank must call it or :meth:`join` here."""
        engine = self.engine
        self._bring_up(engine, step, load)
        return engine

    def join(self, step: int) -> None:
        """Take part in :meth:`sync`'s weight refresh of ``step`` without using the engine
        (a rank where only rank 0 evaluates or serves, and GRPO's version bump after each
        batch): a no-op on the live weights; where this rank has an engine, its weights and
        version brought up to ``step`` without waking it (a sleeping engine's packs are
        rebuilt from them at the wake-up)."""
        if self.built:
            self._bring_up(self.slept if self.asleep else self.engine, step, None)
            return
        live, _ = self.live()
        self.weights.refresh(live, int(step))

    def _bring_up(self, engine: InferenceEngine, step: int, load: Callable[[], Any] | None) -> None:
        if load is None:
            live, _ = self.live()
            load = functools.partial(self.weights.refresh, live, int(step))
            if step <= engine.policy_version:  # a fresh engine's copy is filled at its version
                load()
        if step > engine.policy_version:
            engine.update_weights(load, version=int(step))

    def close(self) -> None:
        """Shut the engine down (a later use builds a fresh one, with the same needs)."""
        if self._engine is not None:
            self._engine.shutdown()
            self._engine = None
        self.weights.release()
