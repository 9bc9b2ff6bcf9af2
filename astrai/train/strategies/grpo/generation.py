"""GRPO's rollouts as training data: prompt + completion batches aligned with the rollout
log-probs, and one generation batch's reuse across micro-steps (TRL's ``_buffered_inputs``).

The prompts of ``steps_per_generation`` micro-steps are generated and scored at once; the
completions are shuffled (when there is more than one slice) and split into that many
slices, and the slices are trained on in turn, ``num_iterations`` times over (``mu`` in the
GRPO paper). Every use reads the rollout's own log-probs as ``old_logp``, so from the second
iteration on the ratio moves away from 1 and the clip engages. The whole state travels in
the checkpoint, so a run interrupted between two uses resumes bit for bit.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from astrai.train.strategies.grpo.packing import PADDED, PaddedRows, RowLayout, RowPacking
from astrai.train.strategies.grpo.sampling import Samples


@dataclass
class Rollouts:
    """Prompt + completion sequences, right-padded, ready for a training forward.

    ``input_ids`` ``[N, S]``; ``mask`` / ``old_logp`` are ``[N, S-1]`` aligned with the
    *targets* ``input_ids[:, 1:]``: 1 (and the rollout log-prob) on completion tokens.
    ``rows``: how a forward lays the sequences out (right-padded, or packed padding-free:
    :mod:`~astrai.train.strategies.grpo.packing`); :meth:`forward` runs a model that way.
    """

    input_ids: Tensor
    mask: Tensor
    old_logp: Tensor
    completion_lengths: Tensor
    rows: RowLayout = field(default_factory=PaddedRows)

    def forward(
        self,
        model: Callable[..., Any],
        per_token: Mapping[str, Tensor] | None = None,
        **kwargs: Any,
    ) -> Any:
        """``model(input_ids, **per_token, **kwargs)``'s outputs ``[N, S, ...]`` (0 on padding),
        computed in ``rows``' layout; ``per_token`` tensors are ``[N, S]`` like the ids."""
        return self.rows.apply(model, self.input_ids, per_token or {}, kwargs)


def build_rollouts(
    prompts: Sequence[Sequence[int]],
    completions: Sequence[Sequence[int]],
    logprobs: Sequence[Sequence[float]],
    pad_id: int = 0,
    device: torch.device | str | None = None,
    action_masks: Sequence[Sequence[int] | None] | None = None,
    packing: RowPacking = PADDED,
) -> Rollouts:
    """Concatenate each prompt with its completion and align the rollout log-probs with the
    shifted targets: completion token ``k`` of a prompt of length ``p`` is target ``p - 1 + k``.
    ``action_masks`` (multi-turn episodes): 1 on the model's own completion tokens, 0 on the
    environment's and the chat template's, which then carry no loss (None: every token).
    ``packing``: the forward's layout of the sequences (default right-padded)."""
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
            action = action_masks[i] if action_masks is not None else None
            if action is None:
                mask[i, len(p) - 1 : len(p) - 1 + len(c)] = 1.0
            elif len(action) != len(c):
                raise ValueError(
                    f"build_rollouts: completion {i} has {len(c)} tokens but an action mask of "
                    f"{len(action)}"
                )
            else:
                mask[i, len(p) - 1 : len(p) - 1 + len(c)] = torch.tensor(
                    list(action), dtype=torch.float32
                )
            old[i, len(p) - 1 : len(p) - 1 + len(c)] = torch.tensor(list(lp), dtype=torch.float32)
    lens = torch.tensor([len(c) for c in completions], dtype=torch.float32)
    if device is not None:
        ids, mask, old, lens = ids.to(device), mask.to(device), old.to(device), lens.to(device)
    return Rollouts(ids, mask, old, lens, packing.layout(lengths, s))


@dataclass
class Slice:
    """The training tensors of one micro-step: ``Rollouts`` plus the advantages (``[N]``, or
    ``[N, S-1]`` aligned with the targets like ``mask``), the loss mask (``mask`` with
    truncated completions zeroed under ``mask_truncated_completions``) and which completions
    were cut by ``max_new_tokens``; ``is_weight`` the off-policy correction of asynchronous
    rollouts (``[N, S-1]`` or ``[N, 1]``; None: on-policy), with ``rollouts.old_logp`` then the
    log-probs of the policy the generation was first trained with."""

    rollouts: Rollouts
    advantages: Tensor
    loss_mask: Tensor
    truncated: Tensor
    is_weight: Tensor | None = None
    values: Tensor | None = None
    returns: Tensor | None = None


@dataclass
class Generation:
    """The completions of one generation batch, in training order, and how far their reuse got.

    ``prompt_ids`` are the loader batch's prompts (one per group), by which the same batch is
    recognised when the loader hands it over again. Per completion: ``prompts``,
    ``completions``, ``logprobs`` (the rollout's), ``truncated``, ``advantages`` (a float, or
    one per completion token). ``bounds`` are the slices' ``[start, end)`` in that order;
    ``repeats`` the micro-steps the generation serves (``num_iterations * len(bounds)``),
    ``used`` how many it has served. ``ref_logp`` keeps each slice's reference log-probs from
    its first use (TRL computes them once per generation), ``metrics`` the generation's reward
    statistics. Multi-turn episodes add ``action_masks`` (1 on the model's tokens; None: all).
    Asynchronous rollouts add ``versions`` (the policy version that sampled each completion),
    and, for completions sampled by an older policy than the one that first trains on them,
    ``old_logprobs`` (that policy's log-probs, the ratio's denominator) and ``is_weights``
    (the truncated importance weight towards it: a list per token, or a float per sequence);
    a ``None`` row is on-policy. PPO adds, per completion token, ``values`` (the critic's at
    rollout time: the value clip's anchor) and ``returns`` (GAE's targets), so a run resumed
    between the micro-steps of a generation batch trains on the same ones.
    """

    prompt_ids: list[list[int]]
    prompts: list[list[int]]
    completions: list[list[int]]
    logprobs: list[list[float]]
    truncated: list[bool]
    advantages: list[Any]
    bounds: list[tuple[int, int]]
    repeats: int
    used: int = 0
    ref_logp: dict[int, Tensor] = field(default_factory=dict)
    metrics: dict[str, float] = field(default_factory=dict)
    action_masks: list[list[int]] | None = None
    versions: list[int] | None = None
    old_logprobs: list[list[float] | None] | None = None
    is_weights: list[Any] | None = None
    values: list[list[float]] | None = None
    returns: list[list[float]] | None = None

    @property
    def spent(self) -> bool:
        return self.used >= self.repeats

    def matches(self, prompt_ids: Sequence[Sequence[int]]) -> bool:
        return [list(p) for p in prompt_ids] == self.prompt_ids

    def take(self) -> int:
        """The slice the next micro-step trains on (slices in turn, ``num_iterations`` times)."""
        if self.spent:
            raise RuntimeError("this generation batch has served all its micro-steps")
        index = self.used % len(self.bounds)
        self.used += 1
        return index

    def slice(
        self,
        index: int,
        *,
        pad_id: int,
        device: torch.device,
        mask_truncated: bool,
        packing: RowPacking = PADDED,
    ) -> Slice:
        start, end = self.bounds[index]
        rows = range(start, end)
        old = self.old_logprobs
        r = build_rollouts(
            [self.prompts[i] for i in rows],
            [self.completions[i] for i in rows],
            [self.logprobs[i] if old is None or old[i] is None else old[i] for i in rows],
            pad_id=pad_id,
            device=device,
            action_masks=None
            if self.action_masks is None
            else [self.action_masks[i] for i in rows],
            packing=packing,
        )
        truncated = torch.tensor([self.truncated[i] for i in rows], device=device)
        loss_mask = (
            r.mask * (~truncated).unsqueeze(-1).to(r.mask.dtype) if mask_truncated else r.mask
        )
        values = [self.advantages[i] for i in rows]
        if values and isinstance(values[0], list):  # one per completion token: align with mask
            adv = self._per_token(rows, self.advantages, r.mask)
        else:
            adv = torch.tensor(values, dtype=torch.float32, device=device)
        return Slice(
            r,
            adv,
            loss_mask,
            truncated,
            self._is_weight(rows, r.mask),
            values=None if self.values is None else self._per_token(rows, self.values, r.mask),
            returns=None if self.returns is None else self._per_token(rows, self.returns, r.mask),
        )

    def _per_token(self, rows: range, per_completion: list[Any], mask: Tensor) -> Tensor:
        """The rows' per-completion-token lists aligned with the targets like ``mask``."""
        out = torch.zeros_like(mask)
        for row, i in enumerate(rows):
            first = len(self.prompts[i]) - 1
            per_token = per_completion[i]
            out[row, first : first + len(per_token)] = torch.tensor(per_token, dtype=out.dtype)
        return out

    def _is_weight(self, rows: range, mask: Tensor) -> Tensor | None:
        """The rows' importance weights aligned like ``mask`` (1 on on-policy rows)."""
        if self.is_weights is None or all(self.is_weights[i] is None for i in rows):
            return None
        per_sequence = any(isinstance(self.is_weights[i], float) for i in rows)
        weight = torch.ones((len(rows), 1) if per_sequence else mask.shape, device=mask.device)
        for row, i in enumerate(rows):
            value = self.is_weights[i]
            if value is None:
                continue
            if per_sequence:
                weight[row, 0] = float(value)
            else:
                first = len(self.prompts[i]) - 1
                weight[row, first : first + len(value)] = torch.tensor(value)
        return weight

    # ------------------------------------------------------------------ checkpoint
    def state_dict(self) -> dict[str, Any]:
        return {
            "prompt_ids": self.prompt_ids,
            "prompts": self.prompts,
            "completions": self.completions,
            "logprobs": self.logprobs,
            "truncated": self.truncated,
            "advantages": self.advantages,
            "bounds": [list(b) for b in self.bounds],
            "repeats": self.repeats,
            "used": self.used,
            "ref_logp": {int(k): v.cpu() for k, v in self.ref_logp.items()},
            "metrics": self.metrics,
            "action_masks": self.action_masks,
            "versions": self.versions,
            "old_logprobs": self.old_logprobs,
            "is_weights": self.is_weights,
            "values": self.values,
            "returns": self.returns,
        }

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> Generation:
        return cls(
            prompt_ids=state["prompt_ids"],
            prompts=state["prompts"],
            completions=state["completions"],
            logprobs=state["logprobs"],
            truncated=state["truncated"],
            advantages=state["advantages"],
            bounds=[(int(a), int(b)) for a, b in state["bounds"]],
            repeats=int(state["repeats"]),
            used=int(state["used"]),
            ref_logp={int(k): v for k, v in state["ref_logp"].items()},
            metrics=dict(state["metrics"]),
            action_masks=state.get("action_masks"),
            versions=state.get("versions"),
            old_logprobs=state.get("old_logprobs"),
            is_weights=state.get("is_weights"),
            values=state.get("values"),
            returns=state.get("returns"),
        )


def split_bounds(n: int, parts: int) -> list[tuple[int, int]]:
    """``parts`` contiguous ranges covering ``[0, n)``, sizes differing by at most one."""
    if n < parts:
        raise ValueError(
            f"GRPO steps_per_generation={parts} needs at least that many completions per "
            f"generation batch, got {n}"
        )
    size, extra = divmod(n, parts)
    bounds, start = [], 0
    for i in range(parts):
        end = start + size + (1 if i < extra else 0)
        bounds.append((start, end))
        start = end
    return bounds


def per_completion(advantages: Tensor, lengths: Sequence[int]) -> list[Any]:
    """Advantages as stored per completion: a float each (``[N]``), or the first
    ``lengths[i]`` values of row ``i`` (``[N, T]``, completion-aligned)."""
    if advantages.dim() == 1:
        return advantages.tolist()
    return [row[:n].tolist() for row, n in zip(advantages.cpu(), lengths)]


def completion_mask(lengths: Sequence[int], device: torch.device | None = None) -> Tensor:
    """``[N, max length]`` float mask: 1 on each completion's tokens."""
    width = max(max(lengths, default=0), 1)
    positions = torch.arange(width, device=device)
    return (positions < torch.tensor(list(lengths), device=device).unsqueeze(-1)).float()


def action_mask(
    lengths: Sequence[int],
    action_masks: Sequence[Sequence[int]] | None,
    device: torch.device | None = None,
) -> Tensor:
    """``[N, max length]``: 1 on the completion tokens that are the model's actions (all of
    them, or the episodes' ``action_masks``)."""
    mask = completion_mask(lengths, device)
    if action_masks is not None:
        for row, action in enumerate(action_masks):
            mask[row, : len(action)] = torch.tensor(list(action), dtype=mask.dtype)
    return mask


def generation_of(
    prompt_ids: Sequence[Sequence[int]],
    samples: Samples,
    advantages: list[Any],
    *,
    group: int,
    steps: int,
    repeats: int,
    seed: int,
    values: list[list[float]] | None = None,
    returns: list[list[float]] | None = None,
) -> Generation:
    """The generation batch of a loader batch's samples (``group`` per prompt) and their
    advantages: shuffled (seeded, as TRL shuffles before splitting) when it is split into
    ``steps > 1`` slices, served ``repeats`` micro-steps; with its reward statistics (and
    PPO's per-token ``values`` and ``returns``, shuffled alike)."""
    n = len(samples.completions)
    order = list(range(n))
    if steps > 1:
        order = torch.randperm(n, generator=torch.Generator().manual_seed(seed)).tolist()
    rewards = samples.reward_tensor
    metrics = {
        "reward_mean": rewards.mean().item(),
        "reward_std": rewards.std().item(),
        **({} if group < 2 else {"zero_var_frac": _zero_var_frac(rewards, group)}),
        "truncated_frac": sum(samples.truncated) / n,
        **{f"reward/{k}": v for k, v in samples.parts.items()},
        **samples.stats,
    }
    masks = samples.action_masks
    return Generation(
        prompt_ids=[list(p) for p in prompt_ids],
        prompts=[samples.prompts[i] for i in order],
        completions=[samples.completions[i] for i in order],
        logprobs=[samples.logprobs[i] for i in order],
        truncated=[samples.truncated[i] for i in order],
        advantages=[advantages[i] for i in order],
        bounds=split_bounds(n, steps),
        repeats=repeats,
        metrics=metrics,
        action_masks=None if masks is None else [masks[i] for i in order],
        versions=[samples.version] * n,
        values=None if values is None else [values[i] for i in order],
        returns=None if returns is None else [returns[i] for i in order],
    )


def _zero_var_frac(rewards: Tensor, group: int) -> float:
    """The fraction of prompts whose ``group`` completions all got the same reward."""
    return (rewards.view(-1, group).std(dim=1) == 0).float().mean().item()
