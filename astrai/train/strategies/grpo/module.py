"""Group relative policy optimisation (GRPO, Shao et al. 2024, DeepSeekMath): the module.

Per generation batch: for every prompt, ``G`` completions come from the module's rollout
source (:mod:`~astrai.train.strategies.grpo.source`: the inference engine on the *live*
policy weights, a generator thread on a copy of them, or a ledger's recorded samples); the
log-probs of the rollout policy come back per token, of the temperature-scaled distribution;
rewards come from the reward registry or a ``_target_``; advantages come from the chosen
estimator (:mod:`~astrai.train.strategies.grpo.advantages`); the loss is the PPO
clipped-ratio objective against the rollout log-probs plus ``kl_coef`` times the k3 estimate
of KL(policy || reference), aggregated over completion tokens as TRL's ``loss_type``
(:mod:`~astrai.train.strategies.grpo.loss`). Like TRL, the training forward divides the
logits by the sampling temperature, so policy, rollout and reference log-probs are of one
quantity.

The options (:class:`~astrai.train.strategies.grpo.options.GRPOOptions`) are described in
docs/training.md ("GRPO options"). The engine's policy version advances after every optimizer
step (``LMModule.policy_engine``), which drops prefix-cache pages built with older weights; a
moving reference (``sync_interval``) travels in the checkpoint.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import Tensor

from astrai.data.sampler import BatchReuse
from astrai.inference import InferenceEngine, SamplingParams
from astrai.likelihood import TokenScores, next_token_targets
from astrai.train.module import LMModule, ReferencePolicy
from astrai.train.policy_engine import PolicyEngine
from astrai.train.ranks import gather_over_ranks, max_over_ranks, sum_over_ranks
from astrai.train.strategies.grpo.advantages import PER_TOKEN, aggregated_advantages
from astrai.train.strategies.grpo.async_source import (
    AsyncSource,
    Staleness,
    correct_staleness,
)
from astrai.train.strategies.grpo.dapo import GlobalTokenNormaliser
from astrai.train.strategies.grpo.dynamic_sampling import DynamicSamplingSource, draw_prompts
from astrai.train.strategies.grpo.engine_source import EngineSource, RolloutEngine
from astrai.train.strategies.grpo.generation import (
    Generation,
    Rollouts,
    Slice,
    action_mask,
    generation_of,
    per_completion,
)
from astrai.train.strategies.grpo.loss import grpo_loss, high_entropy_mask
from astrai.train.strategies.grpo.options import GRPOOptions
from astrai.train.strategies.grpo.policy_losses import global_token_normalised, off_policy_mask
from astrai.train.strategies.grpo.reference import (
    load_reference_state,
    reference_state,
    sync_reference,
)
from astrai.train.strategies.grpo.sampling import Samples
from astrai.train.strategies.grpo.source import RolloutModule, RolloutSource, rollout_index

log = logging.getLogger(__name__)


def _over_ranks(state: Any) -> list[Any]:
    """``state`` of every rank, in rank order (a collective under several processes)."""
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return [state]
    gathered: list[Any] = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(gathered, state)
    return gathered


class GRPOModule(GlobalTokenNormaliser, RolloutModule, LMModule):
    """GRPO on prompt batches (``prompt_ids`` + ``records``, see ``PromptDataset``).

    Args:
        engine: the rollout engine factory of the run's policy engine (``LMModule.
            policy_engine``: one engine on the live weights, shared with the evaluation
            callback and the live policy server), called once, lazily, as ``engine(model,
            tokenizer, start=False, ...)``: the ``engine`` group (conf/engine/) as a Hydra
            partial, sized in conf/strategy/grpo.yaml; None: the first factory a user of the
            policy engine declares, else :class:`~astrai.inference.InferenceEngine`.
        **kwargs: GRPO's options (:class:`~astrai.train.strategies.grpo.options.GRPOOptions`,
            checked there) and ``LMModule``'s (``model``, ``optimizer``, ``tokenizer``
            (required: rewards read decoded completions), ``init_from`` (applied before the
            reference copy is taken), ...).
    """

    def __init__(self, *, engine: Callable[..., InferenceEngine] | None = None, **kwargs: Any):
        if "clip_eps" in kwargs:
            raise ValueError(
                "GRPO clip_eps was renamed epsilon (TRL's name): set strategy.epsilon, and "
                "strategy.epsilon_high for asymmetric clipping"
            )
        if kwargs.get("tokenizer") is None:
            raise ValueError("GRPO needs a tokenizer (rewards read decoded completions)")
        mine, base = GRPOOptions.split(kwargs)
        options = self.parse_options(mine)  # before the model is built
        if options.rollout.mode == "server" and base.get("lora"):
            raise ValueError(
                "strategy.rollout.mode=server with strategy.lora: not supported (the replicas "
                "take full weights); set strategy.lora=null or rollout.mode=colocate"
            )
        super().__init__(**base)
        self.options = options
        # what the dapo normaliser (GlobalTokenNormaliser) reads
        self.loss_type, self.max_new_tokens = options.loss_type, options.max_new_tokens
        self._synced_step = 0  # the optimizer step the reference was last synced at
        if options.kl_coef > 0:  # else no reference model is kept at all
            self.reference = ReferencePolicy(self.model, options.reference_dtype)
        self.policy_engine = PolicyEngine(self.live_policy, engine)
        # what rollouts generate on: the policy engine (colocate) or the replicas (server)
        self.rollout_engine = options.rollout.engine(self.policy_engine)
        # the trainer's engine source (also validation's), and the one training takes from
        self.live_source = self.engine_source(self.rollout_engine, options.sampling)
        self.source: RolloutSource = self.live_source
        if options.async_rollouts is not None:
            self.source = AsyncSource(
                options.async_rollouts,
                self.model,
                self._generator_source,
                self._seed,
                weights=options.rollout.generator_weights,
            )
        if options.dynamic_sampling is not None:  # zero-variance groups out, more prompts in
            self.source = DynamicSamplingSource(
                self.source,
                options.dynamic_sampling,
                options.num_generations,
                lambda seed, count: draw_prompts(self.trainer.train_dataloader, seed, count),
                over_ranks=_over_ranks,
                rank=self._rank,
                any_rank=lambda flag: bool(max_over_ranks(self._trainer)(int(flag))),
            )
        self.staleness = Staleness()
        self.generation: Generation | None = None  # the rollouts being trained on
        self._gen_seconds = 0.0
        self._batch_started: float | None = None
        self.idle_seconds = 0.0  # this micro-step's wait for rollouts (all the sampling when sync)

    @classmethod
    def parse_options(cls, options: Mapping[str, Any]) -> GRPOOptions:
        """The strategy's options, checked (PPO's allow one completion per prompt)."""
        return GRPOOptions.parse(**options)

    # ------------------------------------------------------------------ rollout sources
    def engine_source(self, engine: RolloutEngine, params: SamplingParams) -> EngineSource:
        """An engine source with ``params`` and this module's rewards and environment."""
        o = self.options
        return EngineSource(
            engine,
            params,
            tokenizer=self.tokenizer,
            rewards=o.rewards,
            make_env=o.environment,
            max_turns=o.max_turns,
            reward_workers=o.reward_workers,
            overlong=o.overlong_penalty,
        )

    def _generator_source(self, weights: Any) -> tuple[EngineSource, RolloutEngine]:
        """The asynchronous generator's source, sampling as the live one: colocated, an
        engine of its own on ``weights`` (a copy of the policy); in server mode, the same
        replicas, fed from ``weights`` (the snapshots)."""
        engine = self.options.rollout.generator(self.rollout_engine, weights)
        return self.engine_source(engine, self.live_source.params), engine

    def shard_companions(self, shard: Callable[[torch.nn.Module], None]) -> None:
        if self.options.async_rollouts is not None:  # its generator copies the live policy
            raise ValueError(
                "strategy.async_rollouts: not supported with trainer=fsdp2 (the generator "
                "thread's copy of the policy is not fed from the shards); set "
                "strategy.async_rollouts=null or use trainer=ddp"
            )
        super().shard_companions(shard)

    def wrap_source(self, wrap: Callable[[RolloutSource], RolloutSource]) -> None:
        self.source = wrap(self.source)

    @property
    def engine(self) -> InferenceEngine:
        """The run's engine on the live weights, brought up to the current step."""
        return self.policy_engine.sync(int(self.global_step))

    def _rank(self) -> tuple[int, int]:
        """``(rank, world_size)`` of this process (one process: ``(0, 1)``)."""
        trainer = self._trainer
        if trainer is None:
            return 0, 1
        return int(trainer.global_rank), int(trainer.world_size)

    def _rollout_index(self, ahead: int = 0) -> int:
        """Which rank's which micro-batch this is (or, ``ahead`` generation batches on, will
        be), counted over all ranks (seeds)."""
        return rollout_index(self._trainer, ahead * self.batch_reuse.repeat)

    # ------------------------------------------------------------------ generation batches
    @property
    def generation_steps(self) -> int:
        """Micro-steps per generation batch (``steps_per_generation``, resolved)."""
        if self.options.steps_per_generation is not None:
            return int(self.options.steps_per_generation)
        trainer = self._trainer
        return int(trainer.accumulate_grad_batches) if trainer is not None else 1

    @property
    def batch_reuse(self) -> BatchReuse:
        """The data module's loader batches: ``steps_per_generation`` micro-steps' prompts,
        each handed to ``steps_per_generation * num_iterations`` micro-steps (the one count
        of a generation batch's uses)."""
        steps = self.generation_steps
        return BatchReuse(group=steps, repeat=steps * self.options.num_iterations)

    @property
    def batch_lookahead(self) -> int:
        """Loader batches the data module shows ahead (``batch["upcoming"]``): asynchronous
        rollouts sample that many generation batches ahead."""
        spec = self.options.async_rollouts
        return spec.max_staleness if spec is not None else 0

    def _seed(self, batch: Mapping[str, Any], ahead: int = 0) -> int:
        count = len(batch["prompt_ids"]) * self.options.num_generations
        return self.options.rollout_seed + self._rollout_index(ahead) * count

    def rollout(self, batch: Mapping[str, Any]) -> Generation:
        """``G`` completions per prompt from the source, scored, with their advantages (no
        gradient): the generation batch the next micro-steps train on."""
        started = time.perf_counter()
        seed = self._seed(batch)
        samples = self.source.take(batch, seed, int(self.global_step))
        # engine.enable_sleep_mode: the engine's KV pool and packs are the trainer's until the
        # next rollout (TRL's vllm_enable_sleep_mode window); off: nothing
        self.policy_engine.sleep()
        self.idle_seconds = self.source.waited
        generation = self._generation_of(batch, samples, seed)
        self._gen_seconds = time.perf_counter() - started
        return generation

    def _generation_of(self, batch: Mapping[str, Any], samples: Samples, seed: int) -> Generation:
        o = self.options
        lengths = [len(c) for c in samples.completions]
        mask = None
        if o.advantage in PER_TOKEN:
            mask = action_mask(lengths, samples.action_masks, self.device)
        adv = aggregated_advantages(
            samples.reward_tensor.to(self.device),
            samples.reward_columns,
            o.reward_weights,
            o.num_generations,
            aggregation=o.multi_objective_aggregation,
            advantage=o.advantage,
            scale_rewards=o.scale_rewards,
            mask=mask,
            gamma=o.gamma,
            eps=o.adv_eps,
            all_sum=sum_over_ranks(self._trainer),
        )
        generation = self.new_generation(batch, samples, adv, seed)
        if o.async_rollouts is not None:  # off-policy samples: their staleness, corrected
            gap = int(self.global_step) - samples.version
            generation.metrics.update(self.staleness.record(gap))
            if gap > 0 and o.async_rollouts.importance_sampling_correction != "none":
                pad = self.tokenizer.pad_token_id
                generation.metrics.update(
                    correct_staleness(
                        generation,
                        o.async_rollouts,
                        self._logp_of,
                        pad_id=pad if pad is not None else 0,
                        device=self.device,
                    )
                )
        return generation

    def new_generation(
        self,
        batch: Mapping[str, Any],
        samples: Samples,
        advantages: Tensor,
        seed: int,
        values: Tensor | None = None,
        returns: Tensor | None = None,
    ) -> Generation:
        """The generation batch of ``samples`` with their ``advantages`` (``[N]`` or
        completion-aligned ``[N, T]``; PPO adds its per-token ``values`` and ``returns``),
        split and reused as the data module hands the batch out."""
        for observe in self.rollout_observers:  # e.g. the completions log
            observe(int(self.global_step), samples, advantages)
        lengths = [len(c) for c in samples.completions]
        reuse = self.batch_reuse

        def split(x: Tensor | None) -> list[Any] | None:
            return None if x is None else per_completion(x, lengths)

        return generation_of(
            batch["prompt_ids"],
            samples,
            per_completion(advantages, lengths),
            group=self.options.num_generations,
            steps=reuse.group,
            repeats=reuse.repeat,
            seed=seed,
            values=split(values),
            returns=split(returns),
        )

    def _logp_of(self, rollouts: Rollouts) -> Tensor:
        return self._scores(self.model, rollouts).logp

    def _scores(
        self, model: torch.nn.Module, rollouts: Rollouts, entropy: bool = False
    ) -> TokenScores:
        """``model``'s log-probs (and entropy) of the sampling distribution (TRL: logits /
        temperature) at the completion targets ``input_ids[:, 1:]`` (``[N, S-1]``, 0 off
        ``rollouts.mask``), through the module's head: only completion tokens are scored,
        chunk by chunk, never the full logits (``strategy.logits_chunk_size``), in the
        rollouts' layout (``padding_free``: packed rows)."""
        targets = next_token_targets(rollouts.input_ids, rollouts.mask)

        def score(input_ids: Tensor, targets: Tensor, **forward: Tensor) -> TokenScores:
            return self.head.scores(
                model,
                input_ids,
                targets,
                temperature=self.options.temperature,
                entropy=entropy,
                **forward,
            )

        # in the rollouts' layout (padded, or packed padding-free rows), scattered back
        out = rollouts.forward(score, per_token={"targets": targets})
        return TokenScores(out.logp[:, :-1], out.entropy[:, :-1] if entropy else None)

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
        generation, index, part = self.next_slice(batch)
        return self.policy_loss(generation, index, part)

    def next_slice(self, batch: Mapping[str, Any]) -> tuple[Generation, int, Slice]:
        """The generation batch, the index of the slice this micro-step trains on and its
        training tensors (a new generation batch when the current one is spent)."""
        generation = self._generation_for(batch)
        index = generation.take()
        pad = self.tokenizer.pad_token_id
        part = generation.slice(
            index,
            pad_id=pad if pad is not None else 0,
            device=self.device,
            mask_truncated=self.options.mask_truncated_completions,
            packing=dataclasses.replace(self.options.packing, agree=max_over_ranks(self._trainer)),
        )
        return generation, index, part

    @property
    def loss_kl_coef(self) -> float:
        """The weight of the k3 KL term in the loss (PPO's ``use_kl_in_reward`` moves it to
        the rewards)."""
        return self.options.kl_coef

    def policy_loss(
        self, generation: Generation, index: int, part: Slice
    ) -> tuple[Tensor, dict[str, Tensor]]:
        """The policy objective of slice ``index`` of ``generation`` (the clipped ratio, the
        KL term, TRL's aggregation) and its metrics, the generation's statistics included."""
        r, mask = part.rollouts, part.loss_mask
        self.flops_per_batch = self.flops_per_token * r.input_ids.numel()
        logp, entropy, _ = self._scores(self.model, r, entropy=True)
        keep = None
        if self.options.top_entropy_quantile < 1.0:
            keep = high_entropy_mask(
                entropy, mask, self.options.top_entropy_quantile, gather_over_ranks(self._trainer)
            )
        ref_logp = self._reference_logp(generation, index, r)
        # dapo's normalisation under a trainer: the gradient is that of sum / max_new_tokens,
        # rescaled to the window's global token count in `optimizer_step`; the value is this
        # batch's mean. The entropy bonus is pre-scaled by tokens / max_new_tokens so that the
        # rescale leaves it a token-weighted mean of the micro-batches' bonuses.
        deferred = (
            global_token_normalised(self.loss_type) and self._trainer is not None and self.training
        )
        n_tokens = mask.sum()
        opsm = None
        if self.options.off_policy_mask_threshold is not None:
            opsm = off_policy_mask(
                part.advantages, logp, r.old_logp, mask, self.options.off_policy_mask_threshold
            )
        loss, metrics = grpo_loss(
            logp,
            r.old_logp,
            part.advantages,
            mask,
            loss_type=self.loss_type,
            epsilon=self.options.epsilon,
            epsilon_high=self.options.epsilon_high,
            ref_logp=ref_logp,
            kl_coef=self.loss_kl_coef,
            use_bias_correction_kl=self.options.use_bias_correction_kl,
            max_completion_length=self.max_new_tokens,
            num_items=self.max_new_tokens if deferred else None,
            importance_sampling_level=self.options.importance_sampling_level,
            delta=self.options.delta,
            entropy_mask=keep,
            is_weight=part.is_weight,
            params=self.options.policy_loss,
            entropies=entropy,
            entropy_coef=self.options.entropy_coef,
            entropy_scale=n_tokens / self.max_new_tokens if deferred else 1.0,
            off_policy_mask=opsm,
        )
        if deferred:
            self.count_window_tokens(n_tokens)
            mean = loss.detach() * self.max_new_tokens / n_tokens.clamp(min=1.0)
            loss = loss + (mean - loss.detach())
        metrics.update({k: torch.tensor(v) for k, v in generation.metrics.items()})
        metrics["completion_len"] = r.completion_lengths.mean()
        metrics["entropy"] = (entropy.detach() * r.mask).sum() / r.mask.sum().clamp(min=1.0)
        return loss, metrics

    def _reference_logp(
        self, generation: Generation, index: int, rollouts: Rollouts
    ) -> Tensor | None:
        """The reference's log-probs of slice ``index``, computed at its first use and kept
        for the other iterations (as TRL computes them once per generation)."""
        if self.reference is None:
            return None
        cached = generation.ref_logp.get(index)
        if cached is not None:
            return cached.to(self.device)
        with torch.no_grad():
            ref_logp = self._scores(self.reference.on(self.device), rollouts).logp
        if self.options.num_iterations > 1:
            generation.ref_logp[index] = ref_logp
        return ref_logp

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
        if not self.options.sync_interval or self.reference is None or step == 0:
            return
        if step % self.options.sync_interval == 0 and step != self._synced_step:
            sync_reference(self.reference.on(self.device), self.model, self.options.sync_alpha)
            self._synced_step = step
            log.info("GRPO: reference synced to the policy at step %d", step)

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        super().on_save_checkpoint(checkpoint)
        if self.options.sync_interval and self.reference is not None:  # a moving reference
            checkpoint["grpo_reference"] = reference_state(self.reference.model, self._synced_step)
        if self.generation is not None and not self.generation.spent:  # mid-reuse
            checkpoint["grpo_generation"] = self.generation.state_dict()
        # every rank's generation batch (its own prompts): a checkpoint is written by rank 0
        checkpoint["grpo_generations"] = _over_ranks(checkpoint.get("grpo_generation"))
        # asynchronous: the queued batches' samples (the source waits for them)
        checkpoint.update(self.source.state_dict())

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        super().on_load_checkpoint(checkpoint)
        generation = self._saved_generation(checkpoint)
        self.generation = Generation.from_state(generation) if generation is not None else None
        self.source.load_state_dict(checkpoint)
        saved = checkpoint.get("grpo_reference")
        if self.options.sync_interval and self.reference is not None:
            if saved is None:
                log.warning(
                    "GRPO: the checkpoint has no synced reference (written with sync_interval "
                    "0?); the reference is the initial policy until the next sync"
                )
            else:
                self._synced_step = load_reference_state(self.reference.model, saved)

    def _saved_generation(self, checkpoint: Mapping[str, Any]) -> dict[str, Any] | None:
        """This rank's generation batch of the checkpoint (older ones: rank 0's only)."""
        states = checkpoint.get("grpo_generations")
        if states is None:
            return checkpoint.get("grpo_generation")
        trainer = self._trainer
        world = int(trainer.world_size) if trainer is not None else 1
        if len(states) != world and any(s is not None for s in states):
            raise RuntimeError(
                f"GRPO: the checkpoint was written by {len(states)} rank(s) between the "
                f"micro-steps of a generation batch; it resumes at {len(states)} rank(s) only "
                "(resume at another number of ranks from a checkpoint at a generation "
                "batch's end, e.g. with num_iterations=1 and steps_per_generation=1)"
            )
        return states[int(trainer.global_rank) if trainer is not None else 0] if states else None

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        super().on_train_batch_end(outputs, batch, batch_idx)
        if self._batch_started is not None:
            total = time.perf_counter() - self._batch_started
            if total > 0:
                self.log("train/gen_time_frac", self._gen_seconds / total, batch_size=1)
                self.log("train/trainer_idle_frac", self.idle_seconds / total, batch_size=1)
        # New weights after an optimizer step: bump the policy version of a built engine
        # (drops prefix-cache pages computed with the old weights). `join`, not "sync if
        # built": under FSDP2 the refresh is a collective, and whether this rank has built
        # the engine yet (rank 0's evaluation builds it early) must not decide it.
        self.policy_engine.join(int(self.global_step))

    def validation_step(self, batch: dict[str, Any], batch_idx: int) -> Tensor:
        """Greedy completions (or episodes) for the val prompts; the reward is the metric."""
        samples = self.live_source.sample(
            batch, None, self.options.val_sampling, int(self.global_step)
        )
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
        self.source.close()
        self.rollout_engine.close()  # the replicas' channel (colocate: the policy engine)
        super().teardown(stage)  # closes the policy engine
