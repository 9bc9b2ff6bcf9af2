"""Group relative policy optimisation (GRPO, Shao et al. 2024, DeepSeekMath).

Per training step: for every prompt of the batch, ``G`` completions are sampled by the
inference engine running on the *live* policy weights (``run_batch``, which also returns the
rollout policy's log-probs per token); rewards come from the reward registry; advantages are
normalised within each prompt's group; the loss is the PPO clipped-ratio objective against the
rollout log-probs plus ``kl_coef`` times the k3 estimate of KL(policy || reference), averaged
over all completion tokens of the batch.

One optimizer step is taken per batch of rollouts (``mu = 1`` in the paper's notation); with
gradient accumulation the weights do not change between micro-batches, so the rollout
log-probs stay on-policy and the ratio starts at 1. The engine's policy version is advanced
after every optimizer step, which drops prefix-cache pages built with older weights.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from omegaconf import OmegaConf
from torch import Tensor

from astrai.data.rewards import get_reward
from astrai.inference import InferenceEngine
from astrai.train.module import LMModule, ReferencePolicy, token_logprobs

log = logging.getLogger(__name__)


# ---------------------------------------------------------------------------- pure functions


def group_advantages(rewards: Tensor, eps: float = 1e-4) -> Tensor:
    """``(r - mean_g) / (std_g + eps)`` within each group: ``[B, G] -> [B, G]``.

    ``std`` is the unbiased sample standard deviation (as in DeepSeekMath / TRL); a group whose
    completions all got the same reward has zero advantage and contributes no policy gradient.
    """
    if rewards.dim() != 2:
        raise ValueError(f"group_advantages: expected [prompts, G], got {tuple(rewards.shape)}")
    if rewards.shape[1] < 2:
        raise ValueError("group_advantages: need at least 2 completions per prompt")
    mean = rewards.mean(dim=1, keepdim=True)
    std = rewards.std(dim=1, keepdim=True)
    return (rewards - mean) / (std + eps)


def k3_kl(logp: Tensor, ref_logp: Tensor) -> Tensor:
    """Per-token k3 estimator of KL(pi || ref): ``exp(ref - pi) - (ref - pi) - 1`` (>= 0,
    unbiased, low variance; Schulman 2020)."""
    diff = ref_logp - logp
    return torch.exp(diff) - diff - 1.0


def grpo_loss(
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    clip_eps: float = 0.2,
    ref_logp: Tensor | None = None,
    kl_coef: float = 0.0,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Clipped-ratio policy loss plus ``kl_coef`` * k3 KL, mean over completion tokens.

    Args:
        logp: current policy log-probs of the sampled tokens ``[N, T]`` (with grad).
        old_logp: log-probs of the policy that sampled them (the rollout) ``[N, T]``.
        advantages: one per completion ``[N]`` (broadcast over its tokens).
        mask: 1 on completion tokens ``[N, T]``.
        ref_logp: reference log-probs ``[N, T]`` (needed when ``kl_coef > 0``).
    Returns:
        the loss and detached metrics: ``kl`` (mean k3 over tokens), ``clip_frac`` (share of
        tokens whose clipped term is the active one), ``ratio`` (mean).
    """
    mask = mask.to(logp.dtype)
    n_tokens = mask.sum().clamp(min=1.0)
    adv = advantages.to(logp.dtype).unsqueeze(-1)
    ratio = torch.exp(logp - old_logp)
    unclipped = ratio * adv
    clipped = torch.clamp(ratio, 1.0 - clip_eps, 1.0 + clip_eps) * adv
    per_token = -torch.minimum(unclipped, clipped)
    metrics: dict[str, Tensor] = {}
    if kl_coef:
        if ref_logp is None:
            raise ValueError("grpo_loss: kl_coef > 0 needs ref_logp")
        kl = k3_kl(logp, ref_logp)
        per_token = per_token + kl_coef * kl
        metrics["kl"] = ((kl * mask).sum() / n_tokens).detach()
    elif ref_logp is not None:
        metrics["kl"] = ((k3_kl(logp, ref_logp) * mask).sum() / n_tokens).detach()
    loss = (per_token * mask).sum() / n_tokens
    clip_active = (clipped < unclipped).to(logp.dtype)
    metrics["clip_frac"] = ((clip_active * mask).sum() / n_tokens).detach()
    metrics["ratio"] = ((ratio * mask).sum() / n_tokens).detach()
    return loss, metrics


@dataclass
class Rollouts:
    """Prompt + completion sequences, right-padded, ready for a training forward.

    ``input_ids`` ``[N, S]``; ``mask`` / ``old_logp`` are ``[N, S-1]`` aligned with the
    *targets* ``input_ids[:, 1:]``: 1 (and the rollout log-prob) on completion tokens.
    """

    input_ids: Tensor
    mask: Tensor
    old_logp: Tensor
    completion_lengths: Tensor


def build_rollouts(
    prompts: Sequence[Sequence[int]],
    completions: Sequence[Sequence[int]],
    logprobs: Sequence[Sequence[float]],
    pad_id: int = 0,
    device: torch.device | str | None = None,
) -> Rollouts:
    """Concatenate each prompt with its completion and align the rollout log-probs with the
    shifted targets: completion token ``k`` of a prompt of length ``p`` is target ``p - 1 + k``."""
    if not (len(prompts) == len(completions) == len(logprobs)):
        raise ValueError("build_rollouts: prompts, completions and logprobs differ in length")
    lengths = [len(p) + len(c) for p, c in zip(prompts, completions)]
    s = max(max(lengths), 2)
    n = len(prompts)
    ids = torch.full((n, s), pad_id, dtype=torch.long)
    mask = torch.zeros((n, s - 1), dtype=torch.float32)
    old = torch.zeros((n, s - 1), dtype=torch.float32)
    for i, (p, c, lp) in enumerate(zip(prompts, completions, logprobs)):
        if len(lp) != len(c):
            raise ValueError(
                f"build_rollouts: completion {i} has {len(c)} tokens but {len(lp)} log-probs"
            )
        if not p:
            raise ValueError(f"build_rollouts: prompt {i} is empty")
        ids[i, : len(p)] = torch.tensor(list(p), dtype=torch.long)
        if c:
            ids[i, len(p) : len(p) + len(c)] = torch.tensor(list(c), dtype=torch.long)
            mask[i, len(p) - 1 : len(p) - 1 + len(c)] = 1.0
            old[i, len(p) - 1 : len(p) - 1 + len(c)] = torch.tensor(list(lp), dtype=torch.float32)
    lens = torch.tensor([len(c) for c in completions], dtype=torch.float32)
    if device is not None:
        ids, mask, old, lens = ids.to(device), mask.to(device), old.to(device), lens.to(device)
    return Rollouts(ids, mask, old, lens)


def parse_rewards(rewards: Any) -> list[tuple[str, float]]:
    """Config -> ``[(name, weight)]``: a name, a list of names, a list of ``{name, weight}``
    or a ``{name: weight}`` mapping. Unknown names fail here, before any model is built."""
    if isinstance(rewards, str):
        items: list[tuple[str, float]] = [(rewards, 1.0)]
    elif isinstance(rewards, Mapping):
        items = [(str(k), float(v)) for k, v in rewards.items()]
    else:
        items = []
        for r in rewards:
            if isinstance(r, str):
                items.append((r, 1.0))
            else:
                items.append((str(r["name"]), float(r.get("weight", 1.0))))
    if not items:
        raise ValueError("GRPO needs at least one reward")
    for name, _ in items:
        get_reward(name)  # raises a KeyError listing the registered rewards
    return items


def score(
    records: Sequence[Mapping[str, Any]], texts: Sequence[str], rewards: Sequence[tuple[str, float]]
) -> tuple[Tensor, dict[str, Tensor]]:
    """Weighted sum of the rewards per completion ``[N]``, and each reward's mean."""
    total = torch.zeros(len(texts))
    parts: dict[str, Tensor] = {}
    for name, weight in rewards:
        fn = get_reward(name)
        vals = torch.tensor([float(fn(rec, txt)) for rec, txt in zip(records, texts)])
        parts[name] = vals.mean()
        total += weight * vals
    return total, parts


# ---------------------------------------------------------------------------- the module


class GRPOModule(LMModule):
    """GRPO on prompt batches (``prompt_ids`` + ``records``, see ``PromptDataset``).

    Args:
        num_generations: completions per prompt (``G``); every group needs at least 2.
        max_new_tokens, temperature, top_p, top_k: rollout sampling. The log-probs that come
            back are those of the raw model distribution, like the training forward's.
        rewards: reward names from ``astrai.data.rewards`` with weights, e.g.
            ``[{name: exact_match, weight: 1.0}, {name: format, weight: 0.1}]``.
        clip_eps: PPO clip range of the ratio.
        kl_coef: weight of the k3 KL to a frozen copy of the initial policy (0: no reference
            model is kept at all).
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
        clip_eps: float = 0.2,
        kl_coef: float = 0.04,
        adv_eps: float = 1e-4,
        rollout_seed: int = 0,
        engine: Callable[..., InferenceEngine] | None = None,
        val_max_new_tokens: int | None = None,
        reference_dtype: str | None = None,
        **kwargs: Any,
    ) -> None:
        if num_generations < 2:
            raise ValueError(f"GRPO num_generations must be >= 2, got {num_generations}")
        if kwargs.get("tokenizer") is None:
            raise ValueError("GRPO needs a tokenizer (rewards read decoded completions)")
        reward_items = parse_rewards(_plain_rewards(rewards))
        super().__init__(**kwargs)
        self.num_generations = int(num_generations)
        self.sampling = {
            "max_tokens": int(max_new_tokens),
            "temperature": float(temperature),
            "top_p": float(top_p),
            "top_k": int(top_k),
        }
        self.val_max_new_tokens = int(val_max_new_tokens or max_new_tokens)
        self.rewards = reward_items
        self.clip_eps = float(clip_eps)
        self.kl_coef = float(kl_coef)
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
        self, prompts: Sequence[Sequence[int]], *, seed: int | None, **sampling: Any
    ) -> list[Any]:
        # Generation runs in the parameters' dtype (fp32 master weights), outside any autocast:
        # the KV cache is allocated in that dtype.
        device_type = self.device.type if self.device.type in ("cuda", "cpu") else "cpu"
        with torch.autocast(device_type=device_type, enabled=False):
            results = self.engine.run_batch(prompts, seed=seed, return_details=True, **sampling)
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
        results = self._generate(prompts, seed=seed, **self.sampling)
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
        logp = token_logprobs(self.model(r.input_ids)[:, :-1], targets)
        ref_logp = None
        if self.reference is not None:
            with torch.no_grad():
                ref_logits = self.reference.on(self.device)(r.input_ids)
                ref_logp = token_logprobs(ref_logits[:, :-1], targets)
        loss, metrics = grpo_loss(
            logp,
            r.old_logp,
            adv,
            r.mask,
            clip_eps=self.clip_eps,
            ref_logp=ref_logp,
            kl_coef=self.kl_coef,
        )
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

    # ------------------------------------------------------------------ hooks
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> Any:
        out = super().on_train_batch_start(batch, batch_idx)  # restores RNG states on resume
        self._batch_started = time.perf_counter()
        self._gen_seconds = 0.0
        return out

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
        results = self._generate(
            prompts, seed=None, max_tokens=self.val_max_new_tokens, temperature=0.0
        )
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


def _plain_rewards(rewards: Any) -> Any:
    return (
        OmegaConf.to_container(rewards, resolve=True) if OmegaConf.is_config(rewards) else rewards
    )
