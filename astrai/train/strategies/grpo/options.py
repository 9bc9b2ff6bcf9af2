"""GRPO's options, typed and checked in one place (``conf/strategy/grpo.yaml`` sets them).

The names and meanings are TRL's (``GRPOConfig``) and verl's where they have one, so runs
compare across the frameworks. :meth:`GRPOOptions.parse` checks every option before the model
is built (a bad setting fails at start-up naming its key, not at the first step) and stores
the resolved values: ``epsilon_high`` and ``scale_rewards`` with their defaults applied,
``rewards`` parsed, ``environment`` as a per-episode factory, ``async_rollouts`` as
:class:`~astrai.train.strategies.grpo.async_source.AsyncRollouts` (or None: synchronous).
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from astrai.inference import SamplingParams
from astrai.train.strategies.grpo.advantages import check_advantage_options, check_aggregation
from astrai.train.strategies.grpo.async_source import AsyncRollouts
from astrai.train.strategies.grpo.dynamic_sampling import DynamicSampling
from astrai.train.strategies.grpo.loss import check_loss_options
from astrai.train.strategies.grpo.overlong import NoOverlong, Overlong, OverlongPenalty
from astrai.train.strategies.grpo.packing import DEFAULT_TOKEN_BUDGET, RowPacking
from astrai.train.strategies.grpo.policy_losses import (
    PolicyLossParams,
    check_policy_loss_options,
)
from astrai.train.strategies.grpo.reference import check_sync_options
from astrai.train.strategies.grpo.reward_pool import DEFAULT_WORKERS
from astrai.train.strategies.grpo.rewards import WeightedReward, parse_rewards, plain_config
from astrai.train.strategies.grpo.rollout_mode import Colocate, RolloutMode, parse_rollout
from astrai.train.strategies.grpo.sampling import environment_factory, rollout_sampling


def check_count(name: str, value: object) -> None:
    """A GRPO count option is an int >= 1 (a bool is not)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"GRPO {name} must be an int >= 1, got {value!r}")


def check_reward_workers(value: object) -> int:
    check_count("reward_workers", value)
    return int(value)  # type: ignore[call-overload]


def check_overlong(
    overlong: Overlong, rewards: list[WeightedReward], make_env: Callable[[], Any] | None
) -> Overlong:
    """``overlong_penalty`` is a single-turn column named ``overlong``: not with episodes,
    nor beside a reward of that name."""
    if isinstance(overlong, NoOverlong):
        return overlong
    if make_env is not None:
        raise ValueError(
            "GRPO overlong_penalty: not with strategy.environment (an episode's length is "
            "not one generation's max_new_tokens); set overlong_penalty=null"
        )
    if any(item.name == overlong.name for item in rewards):
        raise ValueError(
            f"GRPO overlong_penalty: a reward is already named {overlong.name!r} (the "
            "penalty's column); rename it"
        )
    return overlong


@dataclass(frozen=True)
class GRPOOptions:
    """Every GRPO option (``strategy.<name>``).

    Attributes:
        num_generations: completions per prompt (``G``); every group needs at least 2.
        max_new_tokens, temperature, top_p, top_k: rollout sampling (temperature > 0); its
            log-probs, the training forward's and the reference's are all of the scaled,
            untruncated distribution (logits / temperature, as TRL; ``logprobs_mode="scaled"``).
        rewards: registry names with weights, e.g. ``[{name: exact_match, weight: 1.0},
            {name: format, weight: 0.1}]``, or ``_target_`` entries (docs/rewards.md).
        loss_type: ``grpo``, ``bnpo``, ``dr_grpo`` or ``dapo`` (TRL's definitions and default,
            :mod:`~astrai.train.strategies.grpo.loss`). ``dapo`` divides by the completion
            tokens of the whole optimizer step (all ranks, all accumulated micro-batches).
        epsilon, epsilon_high: the ratio is clipped to ``[1 - epsilon, 1 + epsilon_high]``
            (``epsilon_high`` None: symmetric; DAPO's clip-higher: 0.28).
        delta: two-sided clipping (INTELLECT-2): the unclipped ratio is capped at ``delta``
            (> 1 + epsilon_high; None: off).
        importance_sampling_level: ``token`` or ``sequence`` (GSPO: one ratio per completion).
        num_iterations: optimisation passes over each generation batch (``mu``).
        steps_per_generation: micro-steps whose prompts are generated at once (TRL's name;
            None: ``accumulate_grad_batches``, TRL's default).
        advantage: ``grpo``, ``rloo``, ``reinforce_pp`` or ``reinforce_pp_baseline`` (verl's
            estimators), with ``scale_rewards`` (TRL's ``group`` / ``batch`` / ``none``; None:
            the estimator's default) and ``gamma`` (REINFORCE++'s discount).
        mask_truncated_completions: completions cut by ``max_new_tokens`` carry no loss
            (DAPO's overlong filtering); they still count in their group's advantages.
        top_entropy_quantile: only this top fraction of completion tokens by entropy carries
            the policy term ("Beyond the 80/20 rule": 0.2; 1: every token).
        kl_coef: weight of the k3 KL to the reference (0: no reference model is kept).
        use_bias_correction_kl: weight the per-token k3 by the importance ratio (TRL 1.16).
        sync_interval, sync_alpha: every ``sync_interval`` optimizer steps the reference
            becomes ``sync_alpha * policy + (1 - sync_alpha) * reference`` (0: frozen).
        adv_eps: added to the std that scales the advantages.
        rollout_seed: rollouts are seeded by this plus the micro-batch count (and the rank),
            so a resumed run samples the same completions as an uninterrupted one.
        val_max_new_tokens: greedy validation generations (None: ``max_new_tokens``).
        reference_dtype: e.g. ``bfloat16`` to halve the frozen reference's memory.
        environment: multi-turn episodes: a ``_target_`` entry (an
            :class:`~astrai.train.environments.Environment`, built once per episode); held
            here as the per-episode factory (None: single-turn rollouts).
        max_turns: the model's turns per episode at most (with ``environment``).
        async_rollouts: ``{max_staleness: K, ...}`` samples the next ``K`` generation batches
            on a generator thread while the trainer trains; None: synchronous.
        rollout: where rollouts are generated (``{mode: colocate}``, the default: the
            trainer's engine; ``{mode: server, servers: [...]}``: rollout replicas,
            :mod:`~astrai.train.strategies.grpo.rollout_mode`).
        padding_free: each micro-step's sequences packed into rows with restarting position
            ids, no pad token computed (TRL's name; same loss and gradients as padded).
        use_dynamic_bsz, ppo_max_token_len_per_gpu: verl's names: the packed rows hold at
            most that many tokens per forward (needs ``padding_free``;
            :mod:`~astrai.train.strategies.grpo.packing`).
        dynamic_sampling: DAPO's dynamic sampling (verl's ``algorithm.filter_groups``):
            ``{metric: reward | <a reward's name>, max_num_gen_batches: N (0: no cap),
            at_cap: fill | raise}``: groups whose metric has no variance are dropped and more
            prompts sampled (:mod:`~astrai.train.strategies.grpo.dynamic_sampling`); None: off.
        reward_workers: synchronous reward calls running at once (a thread pool; ``async``
            rewards run on an event loop); each group is scored as soon as it is generated
            (:mod:`~astrai.train.strategies.grpo.reward_pool`).
        multi_objective_aggregation: ``sum_then_normalize`` (the weighted sum is the reward)
            or ``normalize_then_sum`` (GDPO: each reward normalised in its group, then summed
            and normalised over the batch); TRL's name; ``reward_aggregation`` (``sum`` |
            ``normalize_then_sum``) is accepted as the same.
        overlong_penalty: DAPO's soft overlong punishment (``{len: L_cache, penalty_factor}``)
            as the reward column ``overlong``; held as its
            :class:`~astrai.train.strategies.grpo.overlong.OverlongPenalty` (or a no-op).
        sapo_temperature_pos, sapo_temperature_neg: ``sapo``'s temperatures for tokens with a
            positive / non-positive advantage (TRL's names and defaults).
        clip_cov_ratio, clip_cov_lb, clip_cov_ub: ``clip_cov``'s fraction of tokens and the
            covariance window they are drawn from (verl's names and defaults).
        kl_cov_ratio, ppo_kl_coef: ``kl_cov``'s fraction of tokens by covariance and the weight
            of their ``|log-ratio|`` penalty (verl's names and defaults).
        entropy_coef: TRL's entropy bonus: the loss minus this times the mean entropy over the
            acting tokens (0: off), its gradient through the head's entropy.
        off_policy_mask_threshold: TRL's off-policy sequence mask (DeepSeek-V3.2): a sequence
            with a negative advantage whose mean ``old_logp - logp`` exceeds it carries no
            policy loss (None: off).
    """

    num_generations: int = 8
    max_new_tokens: int = 64
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    rewards: list[WeightedReward] = field(default_factory=list)
    loss_type: str = "dapo"
    epsilon: float = 0.2
    epsilon_high: float = 0.2
    delta: float | None = None
    importance_sampling_level: str = "token"
    num_iterations: int = 1
    steps_per_generation: int | None = 1
    advantage: str = "grpo"
    scale_rewards: str = "group"
    gamma: float = 1.0
    mask_truncated_completions: bool = False
    top_entropy_quantile: float = 1.0
    kl_coef: float = 0.04
    use_bias_correction_kl: bool = True
    sync_interval: int = 0
    sync_alpha: float = 1.0
    adv_eps: float = 1e-4
    rollout_seed: int = 0
    val_max_new_tokens: int = 64
    reference_dtype: str | None = None
    environment: Callable[[], Any] | None = None
    max_turns: int = 4
    async_rollouts: AsyncRollouts | None = None
    padding_free: bool = False
    use_dynamic_bsz: bool = False
    ppo_max_token_len_per_gpu: int = DEFAULT_TOKEN_BUDGET
    rollout: RolloutMode = field(default_factory=Colocate)
    dynamic_sampling: DynamicSampling | None = None
    reward_workers: int = DEFAULT_WORKERS
    multi_objective_aggregation: str = "sum_then_normalize"
    overlong_penalty: Overlong = field(default_factory=NoOverlong)
    sapo_temperature_pos: float = 1.0
    sapo_temperature_neg: float = 1.05
    clip_cov_ratio: float = 0.0002
    clip_cov_lb: float = 1.0
    clip_cov_ub: float = 5.0
    kl_cov_ratio: float = 0.0002
    ppo_kl_coef: float = 1.0
    entropy_coef: float = 0.0
    off_policy_mask_threshold: float | None = None

    @classmethod
    def parse(
        cls,
        *,
        num_generations: int = 8,
        max_new_tokens: int = 64,
        temperature: float = 1.0,
        top_p: float = 1.0,
        top_k: int = 0,
        rewards: Any = ("exact_match",),
        loss_type: str = "dapo",
        epsilon: float = 0.2,
        epsilon_high: float | None = None,
        delta: float | None = None,
        importance_sampling_level: str = "token",
        num_iterations: int = 1,
        steps_per_generation: int | None = 1,
        advantage: str = "grpo",
        scale_rewards: str | bool | None = None,
        gamma: float = 1.0,
        mask_truncated_completions: bool = False,
        top_entropy_quantile: float = 1.0,
        kl_coef: float = 0.04,
        use_bias_correction_kl: bool = True,
        sync_interval: int = 0,
        sync_alpha: float = 1.0,
        adv_eps: float = 1e-4,
        rollout_seed: int = 0,
        val_max_new_tokens: int | None = None,
        reference_dtype: str | None = None,
        environment: Any = None,
        max_turns: int = 4,
        async_rollouts: Any = None,
        padding_free: bool = False,
        use_dynamic_bsz: bool = False,
        ppo_max_token_len_per_gpu: int = DEFAULT_TOKEN_BUDGET,
        rollout: Any = None,
        dynamic_sampling: Any = None,
        reward_workers: int = DEFAULT_WORKERS,
        multi_objective_aggregation: str | None = None,
        reward_aggregation: str | None = None,
        overlong_penalty: Any = None,
        sapo_temperature_pos: float = 1.0,
        sapo_temperature_neg: float = 1.05,
        clip_cov_ratio: float = 0.0002,
        clip_cov_lb: float = 1.0,
        clip_cov_ub: float = 5.0,
        kl_cov_ratio: float = 0.0002,
        ppo_kl_coef: float = 1.0,
        entropy_coef: float = 0.0,
        off_policy_mask_threshold: float | None = None,
    ) -> GRPOOptions:
        """The options as the YAML gives them, checked; every error names its key."""
        if num_generations < 2:
            raise ValueError(f"GRPO num_generations must be >= 2, got {num_generations}")
        if not temperature > 0:
            raise ValueError(
                f"GRPO temperature must be > 0 (the training log-probs are of logits / "
                f"temperature; greedy groups have no variance), got {temperature}"
            )
        eps, eps_high = check_loss_options(
            loss_type,
            epsilon,
            epsilon_high,
            importance_sampling_level=importance_sampling_level,
            delta=delta,
            top_entropy_quantile=top_entropy_quantile,
        )
        check_policy_loss_options(
            loss_type,
            importance_sampling_level=importance_sampling_level,
            sapo_temperature_pos=sapo_temperature_pos,
            sapo_temperature_neg=sapo_temperature_neg,
            clip_cov_ratio=clip_cov_ratio,
            clip_cov_lb=clip_cov_lb,
            clip_cov_ub=clip_cov_ub,
            kl_cov_ratio=kl_cov_ratio,
            ppo_kl_coef=ppo_kl_coef,
            entropy_coef=entropy_coef,
            off_policy_mask_threshold=off_policy_mask_threshold,
        )
        scale = check_advantage_options(advantage, scale_rewards, gamma)
        check_count("num_iterations", num_iterations)
        if steps_per_generation is not None:
            check_count("steps_per_generation", steps_per_generation)
        check_sync_options(sync_interval, sync_alpha, kl_coef)
        check_count("max_turns", max_turns)
        make_env = environment_factory(plain_config(environment))
        rewards = plain_config(rewards)
        reward_items = [] if make_env is not None and not rewards else parse_rewards(rewards)
        sampling = rollout_sampling(max_new_tokens, temperature, top_p, top_k)
        packing = RowPacking.parse(
            padding_free,
            use_dynamic_bsz,
            ppo_max_token_len_per_gpu,
            max_new_tokens=sampling.max_tokens,
        )
        return cls(
            num_generations=int(num_generations),
            max_new_tokens=sampling.max_tokens,
            temperature=sampling.temperature,
            top_p=sampling.top_p,
            top_k=sampling.top_k,
            rewards=reward_items,
            loss_type=loss_type,
            epsilon=eps,
            epsilon_high=eps_high,
            delta=None if delta is None else float(delta),
            importance_sampling_level=importance_sampling_level,
            num_iterations=int(num_iterations),
            steps_per_generation=steps_per_generation,
            advantage=advantage,
            scale_rewards=scale,
            gamma=float(gamma),
            mask_truncated_completions=bool(mask_truncated_completions),
            top_entropy_quantile=float(top_entropy_quantile),
            kl_coef=float(kl_coef),
            use_bias_correction_kl=bool(use_bias_correction_kl),
            sync_interval=int(sync_interval),
            sync_alpha=float(sync_alpha),
            adv_eps=float(adv_eps),
            rollout_seed=int(rollout_seed),
            val_max_new_tokens=int(val_max_new_tokens or max_new_tokens),
            reference_dtype=reference_dtype,
            environment=make_env,
            max_turns=int(max_turns),
            async_rollouts=AsyncRollouts.parse(plain_config(async_rollouts)),
            padding_free=packing.padding_free,
            use_dynamic_bsz=packing.use_dynamic_bsz,
            ppo_max_token_len_per_gpu=packing.ppo_max_token_len_per_gpu,
            rollout=parse_rollout(plain_config(rollout)),
            reward_workers=check_reward_workers(reward_workers),
            multi_objective_aggregation=check_aggregation(
                multi_objective_aggregation, reward_aggregation, advantage, scale
            ),
            overlong_penalty=check_overlong(
                OverlongPenalty.parse(plain_config(overlong_penalty), sampling.max_tokens),
                reward_items,
                make_env,
            ),
            dynamic_sampling=DynamicSampling.parse(
                plain_config(dynamic_sampling),
                reward_names=[r.name for r in reward_items]
                + (["environment"] if make_env is not None else [])
                + (["overlong"] if overlong_penalty is not None else []),
                async_rollouts=async_rollouts is not None and async_rollouts is not False,
            ),
            sapo_temperature_pos=float(sapo_temperature_pos),
            sapo_temperature_neg=float(sapo_temperature_neg),
            clip_cov_ratio=float(clip_cov_ratio),
            clip_cov_lb=float(clip_cov_lb),
            clip_cov_ub=float(clip_cov_ub),
            kl_cov_ratio=float(kl_cov_ratio),
            ppo_kl_coef=float(ppo_kl_coef),
            entropy_coef=float(entropy_coef),
            off_policy_mask_threshold=(
                None if off_policy_mask_threshold is None else float(off_policy_mask_threshold)
            ),
        )

    @classmethod
    def split(cls, kwargs: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
        """``kwargs`` as (GRPO's options, the rest: ``LMModule``'s)."""
        names = {f.name for f in dataclasses.fields(cls)}
        names |= set(inspect.signature(cls.parse).parameters)  # e.g. reward_aggregation
        mine = {k: v for k, v in kwargs.items() if k in names}
        return mine, {k: v for k, v in kwargs.items() if k not in names}

    @property
    def sampling(self) -> SamplingParams:
        """The rollouts' sampling: ``G`` completions per prompt, scaled log-probs."""
        params = rollout_sampling(self.max_new_tokens, self.temperature, self.top_p, self.top_k)
        return dataclasses.replace(params, n=self.num_generations)

    @property
    def packing(self) -> RowPacking:
        """The training forwards' layout (padded, or packed by token budget)."""
        return RowPacking(self.padding_free, self.use_dynamic_bsz, self.ppo_max_token_len_per_gpu)

    @property
    def policy_loss(self) -> PolicyLossParams:
        """The objectives' parameters (:mod:`~astrai.train.strategies.grpo.policy_losses`)."""
        return PolicyLossParams(
            epsilon=self.epsilon,
            epsilon_high=self.epsilon_high,
            delta=self.delta,
            sapo_temperature_pos=self.sapo_temperature_pos,
            sapo_temperature_neg=self.sapo_temperature_neg,
            clip_cov_ratio=self.clip_cov_ratio,
            clip_cov_lb=self.clip_cov_lb,
            clip_cov_ub=self.clip_cov_ub,
            kl_cov_ratio=self.kl_cov_ratio,
            ppo_kl_coef=self.ppo_kl_coef,
            seed=self.rollout_seed,
        )

    @property
    def val_sampling(self) -> SamplingParams:
        """Greedy validation generations."""
        return SamplingParams(max_tokens=self.val_max_new_tokens, temperature=0.0)

    @property
    def reward_weights(self) -> dict[str, float]:
        """Each reward column's weight by name (the rewards', ``overlong``'s when on)."""
        weights = {item.name: item.weight for item in self.rewards}
        weights[self.overlong_penalty.name] = self.overlong_penalty.weight
        return weights
