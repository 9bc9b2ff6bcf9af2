"""GRPO's rollout plumbing: prompt + completion batches aligned with the rollout log-probs,
and the weighted rewards of the registry (``astrai.data.rewards``)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from omegaconf import OmegaConf
from torch import Tensor

from astrai.data.rewards import get_reward


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


def plain_rewards(rewards: Any) -> Any:
    """An OmegaConf rewards config as plain containers (what :func:`parse_rewards` reads)."""
    return (
        OmegaConf.to_container(rewards, resolve=True) if OmegaConf.is_config(rewards) else rewards
    )
