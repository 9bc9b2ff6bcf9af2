"""Group relative policy optimisation (GRPO, Shao et al. 2024, DeepSeekMath).

Per training step: for every prompt of the batch, ``G`` completions are sampled by the
inference engine running on the *live* policy weights (``run_batch``, which also returns the
rollout policy's log-probs per token, of the temperature-scaled distribution); rewards come
from the reward registry; advantages are normalised within each prompt's group; the loss is
the PPO clipped-ratio objective against the rollout log-probs plus ``kl_coef`` times the k3
estimate of KL(policy || reference), aggregated over completion tokens as TRL's ``loss_type``
(:mod:`astrai.train.strategies.grpo_loss`). Like TRL, the training forward divides the logits
by the sampling temperature, so policy, rollout and reference log-probs are of one quantity.

One optimizer step is taken per batch of rollouts (``mu = 1`` in the paper's notation); with
gradient accumulation the weights do not change between micro-batches, so the rollout
log-probs stay on-policy and the ratio starts at 1. The engine's policy version is advanced
after every optimizer step, which drops prefix-cache pages built with older weights. With
``sync_interval > 0`` the reference moves towards the policy every that many optimizer steps
(TRL's ``ref_model_sync_steps``) and travels in the checkpoint.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from astrai.inference import InferenceEngine, SamplingParams
from astrai.train.module import LMModule, ReferencePolicy, token_logprobs
from astrai.train.strategies.grpo_loss import check_loss_options, group_advantages, grpo_loss
from astrai.train.strategies.grpo_rollouts import (
    Rollouts,
    build_rollouts,
    parse_rewards,
    plain_rewards,
    score,
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
def rollout_sampling(
    max_new_tokens: int, temperature: float, top_p: float, top_k: int
) -> SamplingParams:
    """The rollouts' `SamplingParams`, checked now: a bad setting fails before the model is
    built, not at the first training step. Log-probs come back ``scaled`` (see the class)."""
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


class GRPOModule(LMModule):
    """GRPO on prompt batches (``prompt_ids`` + ``records``, see ``PromptDataset``).

    Args:
        num_generations: completions per prompt (``G``); every group needs at least 2.
        max_new_tokens, temperature, top_p, top_k: rollout sampling (temperature > 0). The
            log-probs that come back are of the temperature-scaled, untruncated distribution
            (``logprobs_mode="scaled"``), as are the training forward's and the reference's
            (logits / temperature, as in TRL).
        rewards: reward names from ``astrai.data.rewards`` with weights, e.g.
            ``[{name: exact_match, weight: 1.0}, {name: format, weight: 0.1}]``.
        loss_type: ``grpo``, ``bnpo``, ``dr_grpo`` or ``dapo`` (TRL's definitions and default,
            see :mod:`~astrai.train.strategies.grpo_loss`). ``dapo`` divides by the completion
            tokens of the whole optimizer step (all ranks, all accumulated micro-batches):
            the gradients are rescaled once they are all in, before clipping and the step.
        epsilon, epsilon_high: the ratio is clipped to ``[1 - epsilon, 1 + epsilon_high]``
            (``epsilon_high`` None: symmetric; DAPO's clip-higher: 0.28).
        kl_coef: weight of the k3 KL to the reference, a copy of the initial policy (0: no
            reference model is kept at all).
        use_bias_correction_kl: weight the per-token k3 by the importance ratio (TRL 1.16's
            default and name; the tokens were sampled by the rollout policy).
        sync_interval: every that many optimizer steps the reference becomes
            ``sync_alpha * policy + (1 - sync_alpha) * reference`` (0: frozen reference).
        adv_eps: added to the group std.
        rollout_seed: rollouts are seeded by this plus the micro-batch count, so a resumed
            run samples the same completions as an uninterrupted one.
        engine: the rollout engine factory, called once, lazily, as ``engine(model,
            tokenizer, start=False)`` on the live weights: the ``engine`` group
            (conf/engine/) as a Hydra partial, sized in conf/strategy/grpo.yaml; None:
            :class:`~astrai.inference.InferenceEngine` with its own defaults.
        val_max_new_tokens: greedy validation generations (``val/reward``, ``val/<reward>``;
            ``val/loss`` is the negated weighted reward so that "lower is better" monitors work).
        reference_dtype: e.g. ``bfloat16`` to halve the frozen reference's memory.

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
        kl_coef: float = 0.04,
        use_bias_correction_kl: bool = True,
        sync_interval: int = 0,
        sync_alpha: float = 1.0,
        adv_eps: float = 1e-4,
        rollout_seed: int = 0,
        engine: Callable[..., InferenceEngine] | None = None,
        val_max_new_tokens: int | None = None,
        reference_dtype: str | None = None,
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
        self.epsilon, self.epsilon_high = check_loss_options(loss_type, epsilon, epsilon_high)
        check_sync_options(sync_interval, sync_alpha, kl_coef)
        reward_items = parse_rewards(plain_rewards(rewards))
        sampling = rollout_sampling(max_new_tokens, temperature, top_p, top_k)  # before the model
        super().__init__(**kwargs)
        self.num_generations = int(num_generations)
        self.temperature = sampling.temperature
        self.max_new_tokens = sampling.max_tokens
        self.sampling = sampling
        self.val_max_new_tokens = int(val_max_new_tokens or max_new_tokens)
        self.val_sampling = SamplingParams(max_tokens=self.val_max_new_tokens, temperature=0.0)
        self.rewards = reward_items
        self.loss_type = loss_type
        self.kl_coef = float(kl_coef)
        self.use_bias_correction_kl = bool(use_bias_correction_kl)
        self.sync_interval = int(sync_interval)
        self.sync_alpha = float(sync_alpha)
        self._synced_step = 0  # the optimizer step the reference was last synced at
        self._window_tokens = torch.zeros(())  # dapo: completion tokens of this step's window
        self.adv_eps = float(adv_eps)
        self.rollout_seed = int(rollout_seed)
        self.make_engine: Callable[..., InferenceEngine] = engine or InferenceEngine
        if self.kl_coef > 0:  # else no reference model is kept at all
            self.reference = ReferencePolicy(self.model, reference_dtype)
        self._engine: InferenceEngine | None = None
        self._gen_seconds = 0.0
        self._batch_started: float | None = None

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
        # Generation runs in the parameters' dtype (fp32 master weights), outside any autocast:
        # the KV cache is allocated in that dtype.
        device_type = self.device.type if self.device.type in ("cuda", "cpu") else "cpu"
        with torch.autocast(device_type=device_type, enabled=False):
            results = self.engine.run_batch(prompts, params, seed=seed, return_details=True)
        for i, r in enumerate(results):
            if r.error or r.finish_reason in ("rejected", "aborted"):
                raise RuntimeError(
                    f"GRPO rollout {i} failed ({r.finish_reason}): {r.error}; prompt length "
                    f"{len(prompts[i])}, engine context {self.engine.max_seq_len} (raise "
                    "strategy.engine.max_seq_len?)"
                )
        return results

    def _micro_step(self) -> int:
        try:
            return int(self.trainer.fit_loop.epoch_loop.batch_progress.total.ready)
        except (AttributeError, RuntimeError):
            return 0

    def _decode(self, results: Sequence[Any]) -> list[str]:
        return [self.tokenizer.decode(r.token_ids, skip_special_tokens=True) for r in results]

    # ------------------------------------------------------------------ loss
    def rollout(self, batch: Mapping[str, Any]) -> dict[str, Any]:
        """Sample ``G`` completions per prompt and score them (no gradient)."""
        prompts = [list(p) for p in batch["prompt_ids"] for _ in range(self.num_generations)]
        records = [r for r in batch["records"] for _ in range(self.num_generations)]
        seed = self.rollout_seed + self._micro_step() * len(prompts)
        results = self._generate(prompts, seed=seed, params=self.sampling)
        texts = self._decode(results)
        rewards, parts = score(records, texts, self.rewards)
        return {
            "prompts": prompts,
            "results": results,
            "texts": texts,
            "rewards": rewards,
            "reward_parts": parts,
        }

    def compute_loss(self, batch: dict[str, Any]) -> tuple[Tensor, dict[str, Tensor]]:
        started = time.perf_counter()
        ro = self.rollout(batch)
        self._gen_seconds = time.perf_counter() - started
        rewards = ro["rewards"].view(-1, self.num_generations).to(self.device)
        adv = group_advantages(rewards, self.adv_eps).flatten()
        results = ro["results"]
        pad = self.tokenizer.pad_token_id
        r = build_rollouts(
            ro["prompts"],
            [x.token_ids for x in results],
            [x.logprobs for x in results],
            pad_id=pad if pad is not None else 0,
            device=self.device,
        )
        self.flops_per_batch = self.flops_per_token * r.input_ids.numel()
        targets = r.input_ids[:, 1:]
        logp = token_logprobs(self._scaled(self.model(r.input_ids)[:, :-1]), targets)
        ref_logp = None
        if self.reference is not None:
            with torch.no_grad():
                ref_logits = self.reference.on(self.device)(r.input_ids)
                ref_logp = token_logprobs(self._scaled(ref_logits[:, :-1]), targets)
        # dapo under a trainer: the gradient is that of sum / max_new_tokens, rescaled to the
        # window's global token count in `optimizer_step`; the value is this batch's mean.
        deferred = self.loss_type == "dapo" and self._trainer is not None and self.training
        loss, metrics = grpo_loss(
            logp,
            r.old_logp,
            adv,
            r.mask,
            loss_type=self.loss_type,
            epsilon=self.epsilon,
            epsilon_high=self.epsilon_high,
            ref_logp=ref_logp,
            kl_coef=self.kl_coef,
            use_bias_correction_kl=self.use_bias_correction_kl,
            max_completion_length=self.max_new_tokens,
            num_items=self.max_new_tokens if deferred else None,
        )
        if deferred:
            n_tokens = r.mask.sum()
            self._window_tokens = self._window_tokens.to(n_tokens.device) + n_tokens
            mean = loss.detach() * self.max_new_tokens / n_tokens.clamp(min=1.0)
            loss = loss + (mean - loss.detach())
        group_std = rewards.std(dim=1)
        metrics.update(
            {
                "reward_mean": rewards.mean(),
                "reward_std": rewards.std(),
                "zero_var_frac": (group_std == 0).float().mean(),
                "completion_len": r.completion_lengths.mean(),
                **{f"reward/{k}": v for k, v in ro["reward_parts"].items()},
            }
        )
        return loss, metrics

    def _scaled(self, logits: Tensor) -> Tensor:
        """Logits of the sampling distribution (TRL: ``logits / temperature``)."""
        return logits if self.temperature == 1.0 else logits.float() / self.temperature

    def optimizer_step(
        self,
        epoch: int,
        batch_idx: int,
        optimizer: Any,
        optimizer_closure: Callable[[], Any] | None = None,
    ) -> None:
        """``dapo``: once the last micro-batch's backward is done (inside the closure, so
        before the ``on_before_optimizer_step`` hooks, clipping and the step), rescale the
        gradients from ``sum / max_new_tokens`` per micro-batch to ``sum / T``, where ``T`` is
        the completion-token count of the window summed over all ranks (TRL's
        ``num_items_in_batch``). Lightning divided each micro-batch's loss by
        ``accumulate_grad_batches`` and DDP averaged the ranks, hence the factors."""
        if self.loss_type == "dapo" and optimizer_closure is not None:
            closure = optimizer_closure

            def optimizer_closure() -> Any:
                out = closure()
                self._normalise_by_global_tokens()
                return out

        super().optimizer_step(epoch, batch_idx, optimizer, optimizer_closure)

    @torch.no_grad()
    def _normalise_by_global_tokens(self) -> None:
        tokens = self._window_tokens.to(self.device, torch.float32)
        total = self.trainer.strategy.reduce(tokens, reduce_op="sum")
        factors = self.trainer.world_size * self.trainer.accumulate_grad_batches
        scale = factors * self.max_new_tokens / total.clamp(min=1.0)
        for p in self.parameters():
            if p.grad is not None:
                p.grad.mul_(scale.to(p.grad.dtype))
        self._window_tokens = torch.zeros(())

    # ------------------------------------------------------------------ hooks
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> Any:
        out = super().on_train_batch_start(batch, batch_idx)  # restores RNG states on resume
        self._batch_started = time.perf_counter()
        self._gen_seconds = 0.0
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

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        super().on_load_checkpoint(checkpoint)
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
        # New weights after an optimizer step: bump the policy version (drops prefix-cache
        # pages computed with the old weights).
        if self._engine is not None and self.global_step > self._engine.policy_version:
            self._engine.update_weights(version=int(self.global_step))

    def validation_step(self, batch: dict[str, Any], batch_idx: int) -> Tensor:
        """Greedy completions for the val prompts; the reward is the metric."""
        if self._engine is not None and self.global_step > self._engine.policy_version:
            self._engine.update_weights(version=int(self.global_step))
        prompts = [list(p) for p in batch["prompt_ids"]]
        results = self._generate(prompts, seed=None, params=self.val_sampling)
        rewards, parts = score(batch["records"], self._decode(results), self.rewards)
        bs = len(prompts)
        reward = rewards.mean().to(self.device)
        self.log("val/reward", reward, prog_bar=True, sync_dist=True, batch_size=bs)
        self.log("val/loss", -reward, sync_dist=True, batch_size=bs)
        for k, v in parts.items():
            self.log(f"val/{k}", v.to(self.device), sync_dist=True, batch_size=bs)
        return -reward

    def teardown(self, stage: str) -> None:
        super().teardown(stage)
        if self._engine is not None:
            self._engine.shutdown()
            self._engine = None
