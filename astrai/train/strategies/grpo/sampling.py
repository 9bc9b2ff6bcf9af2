"""GRPO's sampling half: a generation batch's completions, their log-probs and rewards.

Everything here runs without the trainer (no collective, no logging, no module state), so
asynchronous rollouts can run it on their own thread while the trainer trains; what needs
all ranks (advantages, batch statistics) happens when the trainer takes the samples. One
rollout is a single turn (``engine.run_batch`` with ``n = G``: the prompt prefilled once),
or, with an environment, a multi-turn episode (:mod:`astrai.train.environments`).
"""

from __future__ import annotations

import copy
import inspect
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from astrai.inference import InferenceEngine, SamplingParams
from astrai.train.strategies.grpo.reward_pool import RewardPool, reward_pool


def rollout_sampling(
    max_new_tokens: int, temperature: float, top_p: float, top_k: int
) -> SamplingParams:
    """The rollouts' `SamplingParams`, checked now: a bad setting fails before the model is
    built, not at the first training step. Log-probs come back ``scaled``: of the
    temperature-scaled distribution, as the training forward computes them (TRL)."""
    params = SamplingParams(
        max_tokens=int(max_new_tokens),
        temperature=float(temperature),
        top_p=float(top_p),
        top_k=int(top_k),
        logprobs_mode="scaled",
    )
    try:
        return params.validate()
    except ValueError as err:
        raise ValueError(f"GRPO rollout sampling: {err}") from None


@dataclass
class Samples:
    """The rollouts of one generation batch, prompt-major (``G`` per prompt), before
    advantages. Per completion: the ``prompts`` it continues, its ``completions`` and the
    sampling policy's ``logprobs``, whether it was ``truncated``, its ``rewards`` (the
    environment's plus the weighted reward functions'), its ``action_masks`` (episodes only:
    1 on the model's tokens). ``parts`` are each reward's mean, ``stats`` the episodes'
    metrics, ``version`` the engine's policy version that sampled them. ``reward_columns``:
    each reward's unweighted value per completion, by name (episodes add ``environment``,
    the environment's own reward), for per-reward normalisation and filtering."""

    prompts: list[list[int]]
    completions: list[list[int]]
    logprobs: list[list[float]]
    truncated: list[bool]
    rewards: list[float]
    parts: dict[str, float] = field(default_factory=dict)
    action_masks: list[list[int]] | None = None
    stats: dict[str, float] = field(default_factory=dict)
    version: int = 0
    reward_columns: dict[str, list[float]] = field(default_factory=dict)

    def state_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_state(cls, state: Mapping[str, Any]) -> Samples:
        return cls(**dict(state))

    @property
    def reward_tensor(self) -> torch.Tensor:
        return torch.tensor(self.rewards, dtype=torch.float32)


def check_results(results: Sequence[Any], prompts: Sequence[Sequence[int]], n: int, context: int):
    """A rejected or aborted rollout is a configuration or engine fault, not a bad sample."""
    for i, r in enumerate(results):
        if r.error or r.finish_reason in ("rejected", "aborted"):
            raise RuntimeError(
                f"GRPO rollout {i} failed ({r.finish_reason}): {r.error}; prompt length "
                f"{len(prompts[i // n])}, engine context {context} "
                "(raise strategy.engine.max_seq_len?)"
            )


def _weighted(
    pool: RewardPool, columns: Mapping[str, torch.Tensor], count: int
) -> tuple[torch.Tensor, dict[str, float], dict[str, list[float]]]:
    """The weighted total per completion, each column's mean, each column's values."""
    parts = {k: float(v.mean()) for k, v in columns.items()}
    return pool.weighted(columns, count), parts, {k: v.tolist() for k, v in columns.items()}


def engine_generate(
    engine: InferenceEngine,
    prompts: Sequence[Sequence[int]],
    *,
    seed: int | None,
    params: SamplingParams,
    on_group: Callable[[int, list[Any]], None] | None = None,
) -> list[Any]:
    """``params.n`` results per prompt, prompt-major (``run_batch``'s order and seeds);
    ``on_group(i, results)`` as soon as prompt ``i``'s are finished."""
    hook = {} if on_group is None else {"on_group": on_group}  # engine-likes without it
    results = engine.run_batch(prompts, params, seed=seed, return_details=True, **hook)
    check_results(results, prompts, params.n, engine.max_seq_len)
    return results


def sample_turns(
    generate: Callable[..., list[Any]],
    tokenizer: Any,
    prompts: Sequence[Sequence[int]],
    records: Sequence[Mapping[str, Any]],
    params: SamplingParams,
    *,
    seed: int | None,
    rewards: Sequence[Any] | RewardPool,
    version: int,
    overlap: bool = False,
) -> Samples:
    """Single-turn rollouts: ``params.n`` completions per prompt from one call of
    ``generate(prompts, seed=, params=)`` (:func:`engine_generate`). ``overlap``: it also
    takes ``on_group=``, and each group is scored while the others generate."""
    pool = reward_pool(rewards)
    scoring = pool.session([r for r in records for _ in range(params.n)], params.n)

    def decoded(results: Sequence[Any]) -> list[str]:
        return [tokenizer.decode(r.token_ids, skip_special_tokens=True) for r in results]

    if overlap:
        hook = lambda i, group: scoring.group(i, decoded(group))  # noqa: E731
        results = generate(prompts, seed=seed, params=params, on_group=hook)
    else:
        results = generate(prompts, seed=seed, params=params)
    texts = decoded(results)
    columns, failures = scoring.finish(texts, [len(r.token_ids) for r in results])
    total, parts, columns = _weighted(pool, columns, len(texts))
    return Samples(
        prompts=[list(prompts[i // params.n]) for i in range(len(results))],
        completions=[list(r.token_ids) for r in results],
        logprobs=[list(r.logprobs) for r in results],
        truncated=[r.finish_reason == "length" for r in results],
        rewards=total.tolist(),
        parts=parts,
        stats=failures,
        version=version,
        reward_columns=columns,
    )


def sample_episodes(
    engine: InferenceEngine,
    tokenizer: Any,
    make_env: Callable[[], Any],
    records: Sequence[Mapping[str, Any]],
    params: SamplingParams,
    *,
    max_turns: int,
    seed: int | None,
    rewards: Sequence[Any] | RewardPool,
) -> Samples:
    """Multi-turn rollouts: ``params.n`` episodes per record; the reward is the environment's
    sum plus the reward functions' on each episode's final assistant message."""
    from astrai.train.environments import run_episodes

    episodes = run_episodes(
        engine, tokenizer, make_env, records, params, max_turns=max_turns, seed=seed
    )
    per = [r for r in records for _ in range(params.n)]
    pool = reward_pool(rewards)
    scored, failures = pool.score(per, [e.final_text for e in episodes])
    extra, parts, columns = _weighted(pool, scored, len(episodes))
    count = max(len(episodes), 1)
    tokens = sum(len(e.action_mask) for e in episodes)
    total = [e.reward + float(x) for e, x in zip(episodes, extra.tolist())]
    used = [r for r, e in zip(total, episodes) if e.tool_calls > 0]
    unused = [r for r, e in zip(total, episodes) if e.tool_calls == 0]
    stats = {
        "episode/turns": sum(e.turns for e in episodes) / count,
        "episode/tool_calls": sum(e.tool_calls for e in episodes) / count,
        "episode/tool_call_rate": sum(e.tool_calls > 0 for e in episodes) / count,
        "episode/masked_frac": 1.0 - sum(sum(e.action_mask) for e in episodes) / max(tokens, 1),
        "episode/env_errors": float(sum(e.error is not None for e in episodes)),
        # mean reward of the episodes that called a tool / did not (0.0 when there are none)
        "episode/reward_with_tools": sum(used) / len(used) if used else 0.0,
        "episode/reward_without_tools": sum(unused) / len(unused) if unused else 0.0,
        **failures,
    }
    return Samples(
        prompts=[list(e.prompt_ids) for e in episodes],
        completions=[list(e.completion_ids) for e in episodes],
        logprobs=[list(e.logprobs) for e in episodes],
        truncated=[bool(e.truncated) for e in episodes],
        rewards=total,
        parts=parts,
        action_masks=[list(e.action_mask) for e in episodes],
        stats=stats,
        version=int(engine.policy_version),
        reward_columns={"environment": [float(e.reward) for e in episodes], **columns},
    )


def environment_factory(spec: Any) -> Callable[[], Any] | None:
    """``strategy.environment`` as a per-episode factory (TRL's ``environment_factory``): a
    ``_target_`` mapping (built with ``_partial_``, its other keys the constructor's), a
    callable, or an instance (deep-copied per episode). One is built now, so a bad entry
    fails before the model is."""
    if spec is None:
        return None
    if isinstance(spec, Mapping):
        from hydra.utils import instantiate

        if "_target_" not in spec:
            raise ValueError(
                f"GRPO environment needs a _target_ (e.g. astrai.train.environments.Calculator), "
                f"got {dict(spec)!r}"
            )
        config = {k: v for k, v in spec.items() if k != "_partial_"}
        try:
            factory = instantiate(config, _partial_=True)
        except Exception as err:
            raise ValueError(f"GRPO environment {spec['_target_']!r}: {err}") from err
    elif inspect.isclass(spec) or (callable(spec) and not hasattr(spec, "step")):
        factory = spec
    else:
        instance = spec
        factory = lambda: copy.deepcopy(instance)  # noqa: E731
    try:
        probe = factory()
    except Exception as err:
        raise ValueError(f"GRPO environment: building one failed: {err}") from err
    for method in ("reset", "step"):
        if not callable(getattr(probe, method, None)):
            raise ValueError(
                f"GRPO environment {type(probe).__name__} has no {method}() "
                "(see astrai.train.environments.Environment)"
            )
    return factory
