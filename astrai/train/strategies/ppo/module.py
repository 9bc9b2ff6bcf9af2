"""Proximal policy optimisation with a learned critic (PPO, Schulman et al. 2017; the RLHF
recipe of Ouyang et al. 2022, verl's default algorithm): the module.

:class:`PPOModule` is GRPO's module with another advantage estimator and a second model:
rollouts, rewards, the reference, the step ledger and the generation batch's reuse are
GRPO's; the policy loss *is* GRPO's (``GRPOModule.policy_loss``: TRL's clipped objective and
aggregations, the newer objectives, the optional k3 KL term). What PPO adds: a critic
(:class:`~astrai.model.value.ValueModel`, a submodule, so it is in every checkpoint) scores
each completion token at rollout time; GAE (:mod:`~astrai.train.strategies.ppo.gae`) turns
the outcome reward (and, with ``use_kl_in_reward``, a per-token KL penalty) and those values
into advantages and returns, which the generation batch keeps (``Generation.values`` /
``returns``: exact resume between its micro-steps); each micro-step adds ``vf_coef`` times
TRL's clipped value loss (:mod:`~astrai.train.strategies.ppo.value_loss`) to the policy loss.
The critic has its own parameter group (``critic.lr``) in the run's one optimizer, its own
gradient clip (``critic.grad_clip``), trains alone for ``critic.warmup_steps`` optimizer steps,
and exports beside the policy as ``<export>/critic`` (a ``*ForTokenClassification``
directory). Options: :mod:`~astrai.train.strategies.ppo.options`; docs/training.md ("PPO").
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from astrai.model.value import ValueModel, load_value_model, save_value_model
from astrai.train.ranks import sum_over_ranks
from astrai.train.strategies.grpo.generation import (
    Generation,
    action_mask,
    build_rollouts,
)
from astrai.train.strategies.grpo.module import GRPOModule
from astrai.train.strategies.grpo.options import GRPOOptions
from astrai.train.strategies.grpo.policy_losses import global_token_normalised
from astrai.train.strategies.grpo.sampling import Samples
from astrai.train.strategies.ppo.gae import gae_advantage_return, kl_penalty, token_level_rewards
from astrai.train.strategies.ppo.options import PPOOptions
from astrai.train.strategies.ppo.value_loss import clipped_value_loss, explained_variance

log = logging.getLogger(__name__)

#: where the critic's export goes inside the policy's export directory
CRITIC_DIR = "critic"
#: GRPO's advantage options that GAE replaces, at the values that mean "unused"
GAE_REPLACES: dict[str, Any] = {
    "advantage": "grpo",
    "scale_rewards": None,
    "multi_objective_aggregation": None,
    "reward_aggregation": None,
}


def completion_aligned(
    x: Tensor, prompts: Sequence[Sequence[int]], lengths: Sequence[int], width: int
) -> Tensor:
    """Target-aligned ``x`` ``[N, S-1]`` (a rollouts' layout) as ``[N, width]``: column ``t``
    is completion token ``t`` of row ``i`` (target ``len(prompt_i) - 1 + t``), 0 beyond."""
    out = x.new_zeros((x.shape[0], width))
    for row, (prompt, n) in enumerate(zip(prompts, lengths)):
        first = len(prompt) - 1
        out[row, :n] = x[row, first : first + n]
    return out


class PPOModule(GRPOModule):
    """PPO on prompt batches; GRPO's options plus :class:`PPOOptions` (``critic``, ``gamma``,
    ``lam``, ``use_kl_in_reward``, ``kl_penalty``), all checked before a model is built."""

    def __init__(self, **kwargs: Any) -> None:
        mine, rest = PPOOptions.split(kwargs)
        if rest.get("lora"):
            raise ValueError(
                "strategy=ppo with strategy.lora: not supported (the critic copies the "
                "policy's backbone); set strategy.lora=null"
            )
        if rest.get("async_rollouts") not in (None, False):
            raise ValueError(
                "strategy=ppo with strategy.async_rollouts: not supported (the critic scores "
                "each generation batch at rollout time); set strategy.async_rollouts=null"
            )
        for key, default in GAE_REPLACES.items():
            if rest.get(key, default) != default:
                raise ValueError(
                    f"strategy=ppo with strategy.{key}={rest[key]!r}: PPO's advantages are "
                    f"GAE's over the critic's values (gamma, lam), not GRPO's estimator; "
                    f"leave strategy.{key} at {default!r}"
                )
        ppo = PPOOptions.parse(**mine, kl_coef=float(rest.get("kl_coef", 0.04)))
        super().__init__(**rest)
        self.ppo = ppo
        source = ppo.critic.init
        if source == "policy":
            self.critic = ValueModel.from_policy(self.model)
        else:
            self.critic = load_value_model(source, dtype=next(self.model.parameters()).dtype)
            self.critic.gradient_checkpointing = self.model.gradient_checkpointing
        self.critic_flops_per_token = 6.0 * self.critic.num_parameters()
        self.make_optimizer = self._with_critic_group(self.make_optimizer)
        log.info("PPO: critic from %s (%d parameters)", source, self.critic.num_parameters())

    @classmethod
    def parse_options(cls, options: Mapping[str, Any]) -> GRPOOptions:
        """GRPO's options with ``num_generations`` 1 allowed (PPO's advantages are not
        relative to a group: verl's PPO samples one completion per prompt by default)."""
        count = options.get("num_generations", 8)
        if isinstance(count, bool) or not isinstance(count, int) or count < 1:
            raise ValueError(f"PPO num_generations must be an int >= 1, got {count!r}")
        parsed = GRPOOptions.parse(**{**options, "num_generations": max(count, 2)})
        return dataclasses.replace(parsed, num_generations=count)

    # ------------------------------------------------------------------ rollouts
    def _generation_of(self, batch: Mapping[str, Any], samples: Samples, seed: int) -> Generation:
        """The generation batch with GAE's advantages and returns and the critic's values."""
        ppo = self.ppo
        lengths = [len(c) for c in samples.completions]
        width = max(max(lengths, default=0), 1)
        mask = action_mask(lengths, samples.action_masks, self.device)
        values, old_logp, ref_logp = self._rollout_scores(samples, width)
        metrics: dict[str, float] = {}
        kl = None
        if ppo.use_kl_in_reward:
            kl = kl_penalty(old_logp, ref_logp, ppo.kl_penalty) * mask
            per_seq = kl.sum(-1) / mask.sum(-1).clamp(min=1.0)
            metrics["reward_kl_penalty"] = per_seq.mean().item()  # verl's actor/... metric
        rewards = token_level_rewards(
            samples.reward_tensor.to(self.device), mask, kl, self.options.kl_coef
        )
        adv, returns = gae_advantage_return(
            rewards, values, mask, ppo.gamma, ppo.lam, sum_over_ranks(self._trainer)
        )
        keep = mask.bool()
        metrics.update(
            {
                "critic/explained_variance": explained_variance(returns, values, mask),
                "critic/values_mean": values[keep].mean().item() if keep.any() else 0.0,
                "critic/returns_mean": returns[keep].mean().item() if keep.any() else 0.0,
            }
        )
        generation = self.new_generation(batch, samples, adv, seed, values, returns)
        generation.metrics.update(metrics)
        return generation

    @torch.no_grad()
    def _rollout_scores(self, samples: Samples, width: int) -> tuple[Tensor, Tensor, Tensor]:
        """Completion-aligned ``[N, width]``: the critic's values, the rollout log-probs and
        (``use_kl_in_reward``) the reference's log-probs (else zeros), a slice's worth of
        sequences per forward."""
        pad = self.tokenizer.pad_token_id
        n = len(samples.completions)
        chunk = max(1, -(-n // self.generation_steps))
        parts: list[tuple[Tensor, Tensor, Tensor]] = []
        for start in range(0, n, chunk):
            rows = range(start, min(n, start + chunk))
            prompts = [samples.prompts[i] for i in rows]
            completions = [samples.completions[i] for i in rows]
            masks = samples.action_masks
            r = build_rollouts(
                prompts,
                completions,
                [samples.logprobs[i] for i in rows],
                pad_id=pad if pad is not None else 0,
                device=self.device,
                action_masks=None if masks is None else [masks[i] for i in rows],
                packing=self.options.packing,
            )
            lengths = [len(c) for c in completions]
            values = r.forward(self.critic)[:, :-1].float()
            ref = torch.zeros_like(r.old_logp)
            if self.ppo.use_kl_in_reward and self.reference is not None:
                ref = self._scores(self.reference.on(self.device), r).logp
            parts.append(
                tuple(  # type: ignore[arg-type]
                    completion_aligned(x, prompts, lengths, width)
                    for x in (values, r.old_logp, ref)
                )
            )
        return tuple(torch.cat(xs) for xs in zip(*parts))  # type: ignore[return-value]

    # ------------------------------------------------------------------ loss
    @property
    def loss_kl_coef(self) -> float:
        return 0.0 if self.ppo.use_kl_in_reward else self.options.kl_coef

    def _reference_logp(self, generation: Generation, index: int, rollouts: Any) -> Tensor | None:
        if self.ppo.use_kl_in_reward:  # the KL is in the rewards, not the loss
            return None
        return super()._reference_logp(generation, index, rollouts)

    @property
    def critic_warming_up(self) -> bool:
        """Whether this optimizer step trains the critic alone (``critic.warmup_steps``)."""
        return int(self.global_step) < self.ppo.critic.warmup_steps

    def compute_loss(self, batch: dict[str, Any]) -> tuple[Tensor, dict[str, Tensor]]:
        generation, index, part = self.next_slice(batch)
        r, mask = part.rollouts, part.loss_mask
        n_tokens = mask.sum()
        deferred = (
            global_token_normalised(self.loss_type) and self._trainer is not None and self.training
        )
        warming = self.critic_warming_up and self.training
        loss, metrics = self.policy_loss(generation, index, part)
        metrics["policy_loss"] = loss.detach()
        if warming:  # the critic alone: the policy's gradients are dropped before the step
            loss = loss * 0.0  # (computed all the same, so DDP sees every parameter used)
        assert part.values is not None and part.returns is not None
        values = r.forward(self.critic)[:, :-1].float()
        vf_loss, clipfrac = clipped_value_loss(
            values, part.returns, part.values, mask, self.ppo.critic.cliprange_value
        )
        critic_loss = self.ppo.critic.vf_coef * vf_loss
        if deferred:  # as the policy loss: sum / max_new_tokens, rescaled to the window's T
            scaled = critic_loss * n_tokens / self.max_new_tokens
            critic_loss = scaled + (critic_loss.detach() - scaled.detach())
        self.flops_per_batch = (
            self.flops_per_token + self.critic_flops_per_token
        ) * r.input_ids.numel()
        metrics["critic/value_loss"] = vf_loss.detach()
        metrics["critic/vf_clipfrac"] = clipfrac
        metrics["critic/warmup"] = torch.tensor(float(warming))
        return loss + critic_loss, metrics

    # ------------------------------------------------------------------ optimisation
    def _with_critic_group(
        self, make: Callable[[torch.nn.Module], torch.optim.Optimizer]
    ) -> Callable[[torch.nn.Module], torch.optim.Optimizer]:
        """The run's optimizer factory, its optimizer given one more parameter group: the
        critic at ``critic.lr``, no weight decay (before the schedule is built on it, so the
        schedule's multiplier applies to every group)."""

        def optimizer(model: torch.nn.Module) -> torch.optim.Optimizer:
            opt = make(model)
            opt.add_param_group(
                {
                    "params": [p for p in self.critic.parameters() if p.requires_grad],
                    "lr": self.ppo.critic.lr,
                    "weight_decay": 0.0,
                    "name": "critic",
                }
            )
            return opt

        return optimizer

    def configure_gradient_clipping(
        self,
        optimizer: torch.optim.Optimizer,
        gradient_clip_val: float | None = None,
        gradient_clip_algorithm: str | None = None,
    ) -> None:
        """``trainer.gradient_clip_val`` clips the policy's gradients, ``critic.grad_clip``
        the critic's, each by its own norm (verl clips actor and critic apart)."""
        policy = [p for p in self.model.parameters() if p.grad is not None]
        if gradient_clip_val and policy:
            if gradient_clip_algorithm == "value":
                torch.nn.utils.clip_grad_value_(policy, gradient_clip_val)
            else:
                torch.nn.utils.clip_grad_norm_(policy, gradient_clip_val)
        critic = [p for p in self.critic.parameters() if p.grad is not None]
        if self.ppo.critic.grad_clip is not None and critic:
            torch.nn.utils.clip_grad_norm_(critic, self.ppo.critic.grad_clip)

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        """GRPO's gradient statistics and checks, the critic's gradient norm; during the
        critic's warm-up the policy's (zero) gradients are dropped, so the optimizer skips
        its parameters: no update, no weight decay, no step in its Adam moments."""
        super().on_before_optimizer_step(optimizer)
        if self.critic_warming_up:
            for p in self.model.parameters():
                p.grad = None
        grads = [p.grad for p in self.critic.parameters() if p.grad is not None]
        if grads:
            norm = torch.linalg.vector_norm(
                torch.stack([torch.linalg.vector_norm(g) for g in grads])
            )
            self.log("train/critic/grad_norm", norm, batch_size=1)

    def shard_companions(self, shard: Callable[[torch.nn.Module], None]) -> None:
        raise ValueError(
            "strategy=ppo: not supported with trainer=fsdp2 (the critic is not sharded); use "
            "trainer=ddp or one device"
        )

    # ------------------------------------------------------------------ export
    def save_pretrained(self, path: str | Path, **kwargs: Any) -> Path:
        """The policy's export, and the critic's beside it in ``<path>/critic``
        (``*ForTokenClassification``, :func:`~astrai.model.value.save_value_model`)."""
        path = super().save_pretrained(path, **kwargs)
        critic = save_value_model(self.critic, path / CRITIC_DIR, tokenizer=self.tokenizer)
        log.info("PPO: critic exported to %s", critic)
        return path
