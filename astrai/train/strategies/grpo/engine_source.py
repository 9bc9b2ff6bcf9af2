"""Rollouts from an inference engine: single turns (``run_batch`` with ``n = G``: a prompt is
prefilled once and its ``G`` samples share its KV pages) or, with an environment,
multi-turn episodes (:mod:`astrai.train.environments`).

The trainer's source runs on the run's :class:`~astrai.train.policy_engine.PolicyEngine`
(the live weights); an asynchronous source runs one on its own copy of the policy. Nothing
here touches trainer state, so it runs on the generator thread as well.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from astrai.inference import SamplingParams
from astrai.train.policy_engine import PolicyEngine
from astrai.train.remote_policy import RemotePolicy
from astrai.train.strategies.grpo.overlong import Overlong
from astrai.train.strategies.grpo.reward_pool import DEFAULT_WORKERS, RewardPool
from astrai.train.strategies.grpo.rewards import WeightedReward
from astrai.train.strategies.grpo.sampling import (
    Samples,
    engine_generate,
    sample_episodes,
    sample_turns,
)
from astrai.train.strategies.grpo.source import RolloutSource

#: ``generate(prompts, *, seed, params) -> results``: ``params.n`` per prompt, prompt-major
Generate = Callable[..., list[Any]]
#: what a source samples on: the run's engine (colocate) or its replicas (server mode);
#: both have ``sync(step)`` (-> ``run_batch``, ``max_seq_len``, ``policy_version``) and ``live``
RolloutEngine = PolicyEngine | RemotePolicy


class EngineSource(RolloutSource):
    """Samples ``params`` rollouts of a loader batch on ``engine`` (synced to the step): the
    run's engine, or in server mode its replicas (:mod:`astrai.train.remote_policy`).

    ``generate`` is the single-turn call, :meth:`engine_generate` on the engine by default
    (tests replace it with canned results).
    """

    def __init__(
        self,
        engine: RolloutEngine,
        params: SamplingParams,
        *,
        tokenizer: Any,
        rewards: Sequence[WeightedReward],
        make_env: Callable[[], Any] | None = None,
        max_turns: int = 4,
        reward_workers: int = DEFAULT_WORKERS,
        overlong: Overlong | None = None,
    ) -> None:
        self.engine = engine
        self.params = params
        self.tokenizer = tokenizer
        self.rewards = list(rewards)
        self.pool = RewardPool(self.rewards, reward_workers, overlong)
        self.make_env = make_env
        self.max_turns = int(max_turns)
        self.step = 0
        self.generate: Generate = self.engine_generate

    def engine_generate(
        self,
        prompts: Sequence[Sequence[int]],
        *,
        seed: int | None,
        params: SamplingParams,
        on_group: Callable[[int, list[Any]], None] | None = None,
    ) -> list[Any]:
        """``params.n`` results per prompt from the engine, brought up to the step
        (``on_group``: each prompt's as soon as they are finished)."""
        engine = self.engine.sync(self.step)
        return engine_generate(engine, prompts, seed=seed, params=params, on_group=on_group)

    def take(self, batch: Mapping[str, Any], seed: int, step: int) -> Samples:
        started = time.perf_counter()
        samples = self.sample(batch, seed, self.params, step)
        self.waited = time.perf_counter() - started
        return samples

    def sample(
        self, batch: Mapping[str, Any], seed: int | None, params: SamplingParams, step: int
    ) -> Samples:
        """One loader batch's rollouts with ``params`` (validation: greedy, unseeded).
        Generation runs in the parameters' dtype (fp32 master weights), outside any
        autocast: the KV cache is allocated in that dtype."""
        self.step = int(step)
        records = list(batch["records"])
        with torch.autocast(device_type=_autocast_type(self.engine), enabled=False):
            if self.make_env is None:
                return sample_turns(
                    self.generate,
                    self.tokenizer,
                    [list(p) for p in batch["prompt_ids"]],
                    records,
                    params,
                    seed=seed,
                    rewards=self.pool,
                    version=self.step,
                    overlap=self.generate == self.engine_generate,
                )
            return sample_episodes(
                self.engine.sync(self.step),
                self.tokenizer,
                self.make_env,
                records,
                params,
                max_turns=self.max_turns,
                seed=seed,
                rewards=self.pool,
            )


def _autocast_type(engine: RolloutEngine) -> str:
    """The autocast device type of the policy's parameters (cuda or cpu)."""
    model, _ = engine.live()
    device = next(model.parameters()).device
    return device.type if device.type in ("cuda", "cpu") else "cpu"
