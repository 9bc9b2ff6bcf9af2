"""Group relative policy optimisation (GRPO, Shao et al. 2024, DeepSeekMath).

Per generation batch: for every prompt, ``G`` completions are sampled by the inference engine
running on the *live* policy weights (``run_batch`` with ``n = G``: a prompt is prefilled
once and its ``G`` samples share its KV pages; the log-probs of the rollout policy come back
per token, of the temperature-scaled distribution); rewards come from the reward registry or
a ``_target_``; advantages come from the chosen estimator (``advantage``: group-normalised
GRPO, RLOO's leave-one-out, REINFORCE++; :mod:`~astrai.train.strategies.grpo_advantages`);
the loss is the PPO clipped-ratio objective against the rollout log-probs plus ``kl_coef``
times the k3 estimate of KL(policy || reference), aggregated over completion tokens as TRL's
``loss_type`` (:mod:`~astrai.train.strategies.grpo_loss`). Like TRL, the training forward
divides the logits by the sampling temperature, so policy, rollout and reference log-probs
are of one quantity.

Generation batches (``steps_per_generation``, ``num_iterations``: ``batch_reuse``),
multi-turn episodes (``environment``) and asynchronous rollouts (``async_rollouts``) are
described in docs/training.md ("GRPO options") and their modules: grpo_rollouts,
grpo_sampling, grpo_async. The engine's policy version advances after every optimizer step,
which drops prefix-cache pages built with older weights; a moving reference
(``sync_interval``) travels in the checkpoint.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from functools import partial
from typing import Any

import torch
from torch import Tensor

from astrai.data.sampler import BatchReuse
from astrai.inference import InferenceEngine, SamplingParams
from astrai.train.module import LMModule, ReferencePolicy, token_logprobs
from astrai.train.ranks import gather_over_ranks, sum_over_ranks
from astrai.train.strategies.grpo_advantages import (
    PER_TOKEN,
    check_advantage_options,
    compute_advantages,
)
from astrai.train.strategies.grpo_async import (
    AsyncRollouts,
    RolloutQueue,
    RolloutWorker,
    correct_staleness,
    policy_copy,
)
from astrai.train.strategies.grpo_dapo import GlobalTokenNormaliser
from astrai.train.strategies.grpo_loss import (
    check_loss_options,
    grpo_loss,
    high_entropy_mask,
    token_entropy,
)
from astrai.train.strategies.grpo_rewards import parse_rewards, plain_config, score
from astrai.train.strategies.grpo_rollouts import (
    Generation,
    Rollouts,
    action_mask,
    build_rollouts,
    generation_of,
    per_completion,
)
from astrai.train.strategies.grpo_sampling import (
    Samples,
    check_count,
    engine_generate,
    environment_factory,
    rollout_sampling,
    sample_batch,
)
from astrai.train.strategies.reference_sync import (
    check_sync_options,
    load_reference_state,
    reference_state,
    sync_reference,
)

log = logging.getLogger(__name__)


__all__ = ["GRPOModule", "Rollouts", "build_rollouts", "parse_rewards", "score"]


# ---------------------------------------------------------------------------- the module
class GRPOModule(GlobalTokenNormaliser, LMModule):
    """GRPO on prompt batches (``prompt_ids`` + ``records``, see ``PromptDataset``).

    Args:
        num_generations: completions per prompt (``G``); every group needs at least 2.
        max_new_tokens, temperature, top_p, top_k: rollout sampling (temperature > 0); its
            log-probs, the training forward's and the reference's are all of the scaled,
            untruncated distribution (logits / temperature, as TRL; ``logprobs_mode="scaled"``).
        rewards: registry names with weights, e.g. ``[{name: exact_match, weight: 1.0},
            {name: format, weight: 0.1}]``, or ``_target_`` entries (docs/rewards.md).
        loss_type: ``grpo``, ``bnpo``, ``dr_grpo`` or ``dapo`` (TRL's definitions and default,
            see :mod:`~astrai.train.strategies.grpo_loss`). ``dapo`` divides by the completion
            tokens of the whole optimizer step (all ranks, all accumulated micro-batches):
            the gradients are rescaled once they are all in, before clipping and the step.
        epsilon, epsilon_high: the ratio is clipped to ``[1 - epsilon, 1 + epsilon_high]``
            (``epsilon_high`` None: symmetric; DAPO's clip-higher: 0.28).
        delta: two-sided clipping (INTELLECT-2): the unclipped ratio is capped at ``delta``
            (> 1 + epsilon_high; None: off).
        importance_sampling_level: ``token`` or ``sequence`` (GSPO: one ratio per completion,
            the exponentiated mean of its tokens' log-ratios).
        num_iterations: optimisation passes over each generation batch (``mu``); from the
            second on the policy has moved, so the ratio and its clip engage.
        steps_per_generation: micro-steps whose prompts are generated at once (TRL's name;
            None: ``accumulate_grad_batches``, TRL's default); the completions are shuffled and
            split into that many micro-batches of ``batch_size x G``.
        advantage: ``grpo``, ``rloo``, ``reinforce_pp`` or ``reinforce_pp_baseline`` (verl's
            estimators), with ``scale_rewards`` (TRL's ``group`` / ``batch`` / ``none``; None:
            the estimator's default) and ``gamma`` (REINFORCE++'s discount);
            :mod:`~astrai.train.strategies.grpo_advantages`.
        mask_truncated_completions: completions cut by ``max_new_tokens`` carry no loss
            (DAPO's overlong filtering); they still count in their group's advantages.
        top_entropy_quantile: only this top fraction of completion tokens by entropy carries
            the policy term ("Beyond the 80/20 rule": 0.2; 1: every token).
        kl_coef: weight of the k3 KL to the reference, a copy of the initial policy (0: no
            reference model is kept at all).
        use_bias_correction_kl: weight the per-token k3 by the importance ratio (TRL 1.16's
            default and name; the tokens were sampled by the rollout policy).
        sync_interval: every that many optimizer steps the reference becomes
            ``sync_alpha * policy + (1 - sync_alpha) * reference`` (0: frozen reference).
        adv_eps: added to the std that scales the advantages.
        rollout_seed: rollouts are seeded by this plus the micro-batch count (and the rank),
            so a resumed run samples the same completions as an uninterrupted one, and two
            DDP ranks of batch b sample what one process of batch 2b would for b = 1.
        engine: the rollout engine factory, called once, lazily, as ``engine(model,
            tokenizer, start=False)`` on the live weights: the ``engine`` group
            (conf/engine/) as a Hydra partial, sized in conf/strategy/grpo.yaml; None:
            :class:`~astrai.inference.InferenceEngine` with its own defaults.
        val_max_new_tokens: greedy validation generations (``val/reward``, ``val/<reward>``;
            ``val/loss`` is the negated weighted reward so that "lower is better" monitors work).
        reference_dtype: e.g. ``bfloat16`` to halve the frozen reference's memory.
        environment: multi-turn episodes: a ``_target_`` entry (an
            :class:`~astrai.train.environments.Environment`, built once per episode). The reward
            is the environment's plus ``rewards``' on the final assistant message (``rewards``
            may be empty); observation and template tokens carry no loss.
        max_turns: the model's turns per episode at most (with ``environment``).
        async_rollouts: ``{max_staleness: K, ...}`` samples the next ``K`` generation batches
            on a generator thread while the trainer trains (``grpo_async``); None: synchronous.

    The other arguments (``model``, ``optimizer``, ``tokenizer`` (required: rewards read
    decoded completions), ``init_from`` (typically the SFT stage's export), ...) are
    ``LMModule``'s; ``init_from`` is applied before the reference copy is taken.
    """

    def __init__(
        self,
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
        engine: Callable[..., InferenceEngine] | None = None,
        val_max_new_tokens: int | None = None,
        reference_dtype: str | None = None,
        environment: Any = None,
        max_turns: int = 4,
        async_rollouts: Any = None,
        **kwargs: Any,
    ) -> None:
        if num_generations < 2:
            raise ValueError(f"GRPO num_generations must be >= 2, got {num_generations}")
        if "clip_eps" in kwargs:
            raise ValueError(
                "GRPO clip_eps was renamed epsilon (TRL's name): set strategy.epsilon, and "
                "strategy.epsilon_high for asymmetric clipping"
            )
        if kwargs.get("tokenizer") is None:
            raise ValueError("GRPO needs a tokenizer (rewards read decoded completions)")
        if not temperature > 0:
            raise ValueError(
                f"GRPO temperature must be > 0 (the training log-probs are of logits / "
                f"temperature; greedy groups have no variance), got {temperature}"
            )
        self.epsilon, self.epsilon_high = check_loss_options(
            loss_type,
            epsilon,
            epsilon_high,
            importance_sampling_level=importance_sampling_level,
            delta=delta,
            top_entropy_quantile=top_entropy_quantile,
        )
        self.scale_rewards = check_advantage_options(advantage, scale_rewards, gamma)
        check_count("num_iterations", num_iterations)
        if steps_per_generation is not None:
            check_count("steps_per_generation", steps_per_generation)
        check_sync_options(sync_interval, sync_alpha, kl_coef)
        check_count("max_turns", max_turns)
        make_env = environment_factory(plain_config(environment))
        rewards = plain_config(rewards)
        reward_items = [] if make_env is not None and not rewards else parse_rewards(rewards)
        self.async_rollouts = AsyncRollouts.parse(plain_config(async_rollouts))
        sampling = rollout_sampling(max_new_tokens, temperature, top_p, top_k)  # before the model
        super().__init__(**kwargs)
        self.num_generations = int(num_generations)
        self.temperature = sampling.temperature
        self.max_new_tokens = sampling.max_tokens
        self.sampling = dataclasses.replace(sampling, n=self.num_generations)
        self.val_max_new_tokens = int(val_max_new_tokens or max_new_tokens)
        self.val_sampling = SamplingParams(max_tokens=self.val_max_new_tokens, temperature=0.0)
        self.rewards = reward_items
        self.loss_type = loss_type
        self.delta = None if delta is None else float(delta)
        self.importance_sampling_level = importance_sampling_level
        self.num_iterations = int(num_iterations)
        self.steps_per_generation = steps_per_generation
        self.advantage = advantage
        self.gamma = float(gamma)
        self.mask_truncated_completions = bool(mask_truncated_completions)
        self.top_entropy_quantile = float(top_entropy_quantile)
        self.kl_coef = float(kl_coef)
        self.use_bias_correction_kl = bool(use_bias_correction_kl)
        self.sync_interval = int(sync_interval)
        self.sync_alpha = float(sync_alpha)
        self._synced_step = 0  # the optimizer step the reference was last synced at
        self.adv_eps = float(adv_eps)
        self.rollout_seed = int(rollout_seed)
        self.make_engine: Callable[..., InferenceEngine] = engine or InferenceEngine
        if self.kl_coef > 0:  # else no reference model is kept at all
            self.reference = ReferencePolicy(self.model, reference_dtype)
        self._engine: InferenceEngine | None = None
        self.make_env = make_env
        self.max_turns = int(max_turns)
        self.generation: Generation | None = None  # the rollouts being trained on
        self._gen_seconds = 0.0
        self._batch_started: float | None = None
        # asynchronous rollouts: the generator thread and the batches queued on it
        self.queue = RolloutQueue(self._start_worker)
        # the step ledger hears every generation batch's samples; a replay hands them back
        self.sample_listeners: list[Callable[[int, Samples], None]] = []
        self.replay_samples: Callable[[int], Samples] | None = None
        self.idle_seconds = 0.0  # this micro-step's wait for rollouts (all the sampling when sync)

    # ------------------------------------------------------------------ engine
    @property
    def engine(self) -> InferenceEngine:
        """The rollout engine on the live policy weights (built on first use)."""
        if self._engine is None:
            self._engine = self.make_engine(self.model, self.tokenizer, start=False)
            if self.global_step > self._engine.policy_version:  # versions only advance
                self._engine.update_weights(version=int(self.global_step))
        return self._engine

    def _generate(
        self, prompts: Sequence[Sequence[int]], *, seed: int | None, params: SamplingParams
    ) -> list[Any]:
        """``params.n`` results per prompt from the trainer thread's engine."""
        return engine_generate(self.engine, prompts, seed=seed, params=params)

    def _no_autocast(self) -> Any:
        """Generation runs in the parameters' dtype (fp32 master weights), outside any
        autocast: the KV cache is allocated in that dtype."""
        device_type = self.device.type if self.device.type in ("cuda", "cpu") else "cpu"
        return torch.autocast(device_type=device_type, enabled=False)

    def _micro_step(self) -> int:
        try:
            return int(self.trainer.fit_loop.epoch_loop.batch_progress.total.ready)
        except (AttributeError, RuntimeError):
            return 0

    def _rollout_index(self, ahead: int = 0) -> int:
        """Which rank's which micro-batch this is (or, ``ahead`` generation batches on, will
        be), counted over all ranks (seeds)."""
        micro = self._micro_step() + ahead * self.batch_reuse.repeat
        trainer = self._trainer
        if trainer is None or trainer.world_size == 1:
            return micro
        return micro * int(trainer.world_size) + int(trainer.global_rank)

    # ------------------------------------------------------------------ generation batches
    @property
    def generation_steps(self) -> int:
        """Micro-steps per generation batch (``steps_per_generation``, resolved)."""
        if self.steps_per_generation is not None:
            return int(self.steps_per_generation)
        trainer = self._trainer
        return int(trainer.accumulate_grad_batches) if trainer is not None else 1

    @property
    def batch_reuse(self) -> BatchReuse:
        """The data module's loader batches: ``steps_per_generation`` micro-steps' prompts,
        each handed to ``steps_per_generation * num_iterations`` micro-steps."""
        steps = self.generation_steps
        return BatchReuse(group=steps, repeat=steps * self.num_iterations)

    @property
    def batch_lookahead(self) -> int:
        """Loader batches the data module shows ahead (``batch["upcoming"]``): asynchronous
        rollouts sample that many generation batches ahead."""
        return self.async_rollouts.max_staleness if self.async_rollouts is not None else 0

    def sample(
        self,
        batch: Mapping[str, Any],
        seed: int | None,
        params: SamplingParams | None = None,
        engine: InferenceEngine | None = None,
    ) -> Samples:
        """The rollouts of one loader batch (``params``: the rollout sampling) on ``engine``
        (None: the trainer thread's): no trainer state is touched, so the generator thread
        runs this too, on its own engine."""
        with self._no_autocast():
            return sample_batch(
                batch,
                seed,
                params or self.sampling,
                generate=self._generate if engine is None else partial(engine_generate, engine),
                engine_of=lambda: engine or self.engine,
                tokenizer=self.tokenizer,
                make_env=self.make_env,
                max_turns=self.max_turns,
                rewards=self.rewards,
                version=int(self.global_step if engine is None else engine.policy_version),
            )

    def _seed(self, batch: Mapping[str, Any], ahead: int = 0) -> int:
        count = len(batch["prompt_ids"]) * self.num_generations
        return self.rollout_seed + self._rollout_index(ahead) * count

    def rollout(self, batch: Mapping[str, Any]) -> Generation:
        """Sample ``G`` completions per prompt (or take them from the generator thread), score
        them and compute their advantages (no gradient): the generation batch the next
        micro-steps train on."""
        started = time.perf_counter()
        seed = self._seed(batch)
        waited = time.perf_counter()
        if self.replay_samples is not None:  # a replay: the ledger's rollouts, no engine
            samples = self.replay_samples(seed)
        elif self.async_rollouts is None:
            samples = self.sample(batch, seed)
        else:
            future = self._queued(batch, seed)
            waited = time.perf_counter()
            samples = future.result()
        self.idle_seconds = time.perf_counter() - waited
        for listener in self.sample_listeners:
            listener(seed, samples)
        generation = self._generation_of(batch, samples, seed)
        self._gen_seconds = time.perf_counter() - started
        return generation

    def _generation_of(self, batch: Mapping[str, Any], samples: Samples, seed: int) -> Generation:
        lengths = [len(c) for c in samples.completions]
        mask = None
        if self.advantage in PER_TOKEN:
            mask = action_mask(lengths, samples.action_masks, self.device)
        adv = compute_advantages(
            samples.reward_tensor.to(self.device),
            self.num_generations,
            advantage=self.advantage,
            scale_rewards=self.scale_rewards,
            mask=mask,
            gamma=self.gamma,
            eps=self.adv_eps,
            all_sum=sum_over_ranks(self._trainer),
        )
        generation = generation_of(
            batch["prompt_ids"],
            samples,
            per_completion(adv, lengths),
            group=self.num_generations,
            steps=self.generation_steps,
            repeats=self.generation_steps * self.num_iterations,
            seed=seed,
        )
        if self.async_rollouts is not None:
            gap = int(self.global_step) - samples.version
            generation.metrics.update(self.queue.record(gap))
            if gap > 0 and self.async_rollouts.importance_sampling_correction != "none":
                pad = self.tokenizer.pad_token_id
                generation.metrics.update(
                    correct_staleness(
                        generation,
                        self.async_rollouts,
                        self._logp_of,
                        pad_id=pad if pad is not None else 0,
                        device=self.device,
                    )
                )
        return generation

    # ------------------------------------------------------------------ asynchronous rollouts
    def _start_worker(self) -> RolloutWorker:
        """The generator thread, its engine on a copy of the policy as it is now."""
        model = policy_copy(self.model)
        engine = self.make_engine(model, self.tokenizer, start=False)
        if self.global_step > engine.policy_version:
            engine.update_weights(version=int(self.global_step))
        return RolloutWorker(engine, model, self.async_rollouts.generator_threads)

    def _job(self, batch: Mapping[str, Any], seed: int) -> Callable[[InferenceEngine], Samples]:
        part = {"prompt_ids": [list(p) for p in batch["prompt_ids"]], "records": batch["records"]}
        return lambda engine: self.sample(part, seed, engine=engine)

    def _queued(self, batch: Mapping[str, Any], seed: int) -> Future:
        """This batch's rollouts from the generator, after queueing the next ones the loader
        showed (``batch["upcoming"]``)."""
        upcoming = list(batch.get("upcoming") or [])[: self.batch_lookahead]
        later = [(b, self._seed(b, ahead)) for ahead, b in enumerate(upcoming, start=1)]
        return self.queue.take(batch, seed, later, self._job, self.model, int(self.global_step))

    def _logp_of(self, rollouts: Rollouts) -> Tensor:
        return token_logprobs(self._policy_logits(rollouts.input_ids), rollouts.input_ids[:, 1:])

    def _policy_logits(self, input_ids: Tensor) -> Tensor:
        """The policy's logits of the sampling distribution at every target position."""
        return self._scaled(self.model(input_ids)[:, :-1])

    def _generation_for(self, batch: Mapping[str, Any]) -> Generation:
        """The current generation batch, or a new one when it has served all its steps."""
        current = self.generation
        if current is None or current.spent:
            current = self.generation = self.rollout(batch)
        elif not current.matches(batch["prompt_ids"]):
            raise RuntimeError(
                f"GRPO: the loader handed over other prompts while a generation batch had "
                f"{current.repeats - current.used} of its {current.repeats} micro-steps left "
                "(the data module must repeat each batch: LMModule.batch_reuse)"
            )
        return current

    # ------------------------------------------------------------------ loss
    def compute_loss(self, batch: dict[str, Any]) -> tuple[Tensor, dict[str, Tensor]]:
        generation = self._generation_for(batch)
        index = generation.take()
        pad = self.tokenizer.pad_token_id
        part = generation.slice(
            index,
            pad_id=pad if pad is not None else 0,
            device=self.device,
            mask_truncated=self.mask_truncated_completions,
        )
        r, mask = part.rollouts, part.loss_mask
        self.flops_per_batch = self.flops_per_token * r.input_ids.numel()
        targets = r.input_ids[:, 1:]
        logits = self._policy_logits(r.input_ids)
        logp = token_logprobs(logits, targets)
        entropy = token_entropy(logits, r.mask)
        keep = None
        if self.top_entropy_quantile < 1.0:
            keep = high_entropy_mask(
                entropy, mask, self.top_entropy_quantile, gather_over_ranks(self._trainer)
            )
        ref_logp = self._reference_logp(generation, index, r.input_ids, targets)
        # dapo under a trainer: the gradient is that of sum / max_new_tokens, rescaled to the
        # window's global token count in `optimizer_step`; the value is this batch's mean.
        deferred = self.loss_type == "dapo" and self._trainer is not None and self.training
        loss, metrics = grpo_loss(
            logp,
            r.old_logp,
            part.advantages,
            mask,
            loss_type=self.loss_type,
            epsilon=self.epsilon,
            epsilon_high=self.epsilon_high,
            ref_logp=ref_logp,
            kl_coef=self.kl_coef,
            use_bias_correction_kl=self.use_bias_correction_kl,
            max_completion_length=self.max_new_tokens,
            num_items=self.max_new_tokens if deferred else None,
            importance_sampling_level=self.importance_sampling_level,
            delta=self.delta,
            entropy_mask=keep,
            is_weight=part.is_weight,
        )
        if deferred:
            n_tokens = mask.sum()
            self.count_window_tokens(n_tokens)
            mean = loss.detach() * self.max_new_tokens / n_tokens.clamp(min=1.0)
            loss = loss + (mean - loss.detach())
        metrics.update({k: torch.tensor(v) for k, v in generation.metrics.items()})
        metrics["completion_len"] = r.completion_lengths.mean()
        metrics["entropy"] = (entropy * r.mask).sum() / r.mask.sum().clamp(min=1.0)
        return loss, metrics

    def _reference_logp(
        self, generation: Generation, index: int, input_ids: Tensor, targets: Tensor
    ) -> Tensor | None:
        """The reference's log-probs of slice ``index``, computed at its first use and kept
        for the other iterations (as TRL computes them once per generation)."""
        if self.reference is None:
            return None
        cached = generation.ref_logp.get(index)
        if cached is not None:
            return cached.to(self.device)
        with torch.no_grad():
            ref_logits = self.reference.on(self.device)(input_ids)
            ref_logp = token_logprobs(self._scaled(ref_logits[:, :-1]), targets)
        if self.num_iterations > 1:
            generation.ref_logp[index] = ref_logp
        return ref_logp

    def _scaled(self, logits: Tensor) -> Tensor:
        """Logits of the sampling distribution (TRL: ``logits / temperature``)."""
        return logits if self.temperature == 1.0 else logits.float() / self.temperature

    # ------------------------------------------------------------------ hooks
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> Any:
        out = super().on_train_batch_start(batch, batch_idx)  # restores RNG states on resume
        self._batch_started = time.perf_counter()
        self._gen_seconds = self.idle_seconds = 0.0
        self._maybe_sync_reference()
        return out

    def _maybe_sync_reference(self) -> None:
        """At the first batch after every ``sync_interval``-th optimizer step (also the first
        batch after a resume from that step): the reference moves towards the policy."""
        step = int(self.global_step)
        if not self.sync_interval or self.reference is None or step == 0:
            return
        if step % self.sync_interval == 0 and step != self._synced_step:
            sync_reference(self.reference.on(self.device), self.model, self.sync_alpha)
            self._synced_step = step
            log.info("GRPO: reference synced to the policy at step %d", step)

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        super().on_save_checkpoint(checkpoint)
        if self.sync_interval and self.reference is not None:  # a moving reference
            checkpoint["grpo_reference"] = reference_state(self.reference.model, self._synced_step)
        if self.generation is not None and not self.generation.spent:  # mid-reuse
            checkpoint["grpo_generation"] = self.generation.state_dict()
        if self.queue.pending:  # asynchronous: wait for the queued batches, keep their samples
            checkpoint["grpo_pending"] = self.queue.state_dict()

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        super().on_load_checkpoint(checkpoint)
        generation = checkpoint.get("grpo_generation")
        self.generation = Generation.from_state(generation) if generation is not None else None
        self.queue.load_state_dict(checkpoint.get("grpo_pending", []))
        saved = checkpoint.get("grpo_reference")
        if self.sync_interval and self.reference is not None:
            if saved is None:
                log.warning(
                    "GRPO: the checkpoint has no synced reference (written with sync_interval "
                    "0?); the reference is the initial policy until the next sync"
                )
            else:
                self._synced_step = load_reference_state(self.reference.model, saved)

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        super().on_train_batch_end(outputs, batch, batch_idx)
        if self._batch_started is not None:
            total = time.perf_counter() - self._batch_started
            if total > 0:
                self.log("train/gen_time_frac", self._gen_seconds / total, batch_size=1)
                self.log("train/trainer_idle_frac", self.idle_seconds / total, batch_size=1)
        # New weights after an optimizer step: bump the policy version (drops prefix-cache
        # pages computed with the old weights).
        if self._engine is not None and self.global_step > self._engine.policy_version:
            self._engine.update_weights(version=int(self.global_step))

    def validation_step(self, batch: dict[str, Any], batch_idx: int) -> Tensor:
        """Greedy completions (or episodes) for the val prompts; the reward is the metric."""
        if self._engine is not None and self.global_step > self._engine.policy_version:
            self._engine.update_weights(version=int(self.global_step))
        samples = self.sample(batch, None, self.val_sampling)
        bs = len(batch["prompt_ids"])
        reward = samples.reward_tensor.mean().to(self.device)
        self.log("val/reward", reward, prog_bar=True, sync_dist=True, batch_size=bs)
        self.log("val/loss", -reward, sync_dist=True, batch_size=bs)
        for k, v in samples.parts.items():
            self.log(f"val/{k}", torch.tensor(v, device=self.device), sync_dist=True, batch_size=bs)
        for k, v in samples.stats.items():
            self.log(f"val/{k}", torch.tensor(v, device=self.device), sync_dist=True, batch_size=bs)
        return -reward

    def teardown(self, stage: str) -> None:
        super().teardown(stage)
        self.queue.close()
        if self._engine is not None:
            self._engine.shutdown()
            self._engine = None
