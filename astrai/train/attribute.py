"""Which samples of a step pushed the model towards a behaviour: leave-one-out replays.

From the state after step K-1 (`Rebuilder`), step K is re-run once as recorded and once with
each rollout group left out (GRPO, PPO: one prompt's ``G`` completions, from the ledger's
rollouts) or each slice of the batch left out (the other strategies: ``slices`` equal slices of
every micro-batch's rows), and every result is probed with the same per-request seeds (common
random numbers). A unit's push is how far leaving it out moves the probe's metric back against
the condition's direction (``exact_match < 0.5``: the exact match it costs); units are ranked
by it, with their text, rewards and advantages.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback
from torch import Tensor

from astrai.train.probe import Condition, Probe
from astrai.train.rebuild import Rebuilder
from astrai.train.replay import ReplayError
from astrai.train.strategies.grpo.sampling import Samples
from astrai.train.strategies.grpo.source import RolloutModule, RolloutSource, WrappingSource

log = logging.getLogger(__name__)

__all__ = ["Attribution", "Unit", "attribute", "format_attribution"]


# ---------------------------------------------------------------------- leaving out
def drop_group(samples: Samples, group: int | None, size: int) -> Samples:
    """``samples`` without prompt ``group``'s ``size`` completions (None: all kept)."""
    if group is None:
        return samples
    keep = [i for i in range(len(samples.completions)) if i // size != group]

    def pick(values: Sequence[Any] | None) -> Any:
        return None if values is None else [values[i] for i in keep]

    return Samples(
        prompts=pick(samples.prompts),
        completions=pick(samples.completions),
        logprobs=pick(samples.logprobs),
        truncated=pick(samples.truncated),
        rewards=pick(samples.rewards),
        parts=dict(samples.parts),
        action_masks=pick(samples.action_masks),
        stats=dict(samples.stats),
        version=samples.version,
        reward_columns={k: pick(v) for k, v in samples.reward_columns.items()},
    )


class LeaveOutSource(WrappingSource):
    """The wrapped source's samples without one prompt's group; keeps what it took."""

    def __init__(self, inner: RolloutSource, group: int | None, size: int) -> None:
        super().__init__(inner)
        self.group, self.size = group, size
        self.taken: Samples | None = None

    def take(self, batch: Mapping[str, Any], seed: int, step: int) -> Samples:
        self.taken = self.inner.take(batch, seed, step)
        self.waited = self.inner.waited
        return drop_group(self.taken, self.group, self.size)


class LeaveOutGroup(Callback):
    """Wraps a rollout module's source for one counterfactual step, and records the step's
    full samples and the advantages it trained on."""

    def __init__(self, group: int | None) -> None:
        self.group = group
        self.source: LeaveOutSource | None = None
        self.advantages: list[float] = []

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not isinstance(pl_module, RolloutModule):
            raise ReplayError("leaving out rollout groups needs a GRPO/PPO run")
        size = int(pl_module.options.num_generations)

        def wrap(source: RolloutSource) -> RolloutSource:
            self.source = LeaveOutSource(source, self.group, size)
            return self.source

        def observe(step: int, samples: Samples, advantages: Tensor) -> None:
            flat = advantages.detach().float().cpu()
            self.advantages = (flat if flat.dim() == 1 else flat[:, 0]).tolist()

        pl_module.wrap_source(wrap)
        pl_module.observe_rollouts(observe)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.source is None or self.source.taken is None:
            raise ReplayError(
                "this step trains on a generation batch sampled at an earlier step "
                "(num_iterations or steps_per_generation > 1): attribute the step that sampled it"
            )


def slice_rows(batch: Any, drop: int, slices: int) -> Any:
    """``batch`` (a mapping of ``[B, ...]`` tensors and length-``B`` lists) without the rows
    of slice ``drop`` of ``slices`` (row ``r`` is in slice ``r * slices // B``)."""
    if not isinstance(batch, Mapping):
        raise ReplayError(f"leaving out a slice needs a batch of named tensors, got {type(batch)}")
    rows = {len(v) for v in batch.values() if isinstance(v, Tensor | list) and len(v)}
    if len(rows) != 1:
        raise ReplayError(
            "leaving out a slice needs one row count across the batch (a packed / padding-free "
            f"batch has none): found {sorted(rows)}"
        )
    (b,) = rows
    keep = [r for r in range(b) if r * slices // b != drop]
    index = torch.tensor(keep, dtype=torch.long)
    out = {}
    for key, value in batch.items():
        if isinstance(value, Tensor) and value.dim() and len(value) == b:
            out[key] = value.index_select(0, index.to(value.device))
        elif isinstance(value, list) and len(value) == b:
            out[key] = [value[r] for r in keep]
        else:
            out[key] = value
    return out


class LeaveOutSlice(Callback):
    """Takes slice ``drop`` of ``slices`` out of every micro-batch of the step."""

    def __init__(self, drop: int | None, slices: int) -> None:
        self.drop, self.slices = drop, int(slices)

    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if self.drop is None:
            return
        smaller = slice_rows(batch, self.drop, self.slices)
        batch.clear()  # the same mapping reaches training_step
        batch.update(smaller)


# ---------------------------------------------------------------------- results
@dataclass
class Unit:
    """One left-out group or slice and what leaving it out did."""

    index: int
    push: float
    metric_without: float
    prompt: str = ""
    completions: list[dict[str, Any]] = field(default_factory=list)
    sample_ids: list[int] = field(default_factory=list)
    rank: int = 0


@dataclass
class Attribution:
    step: int
    kind: str  # "group" | "slice"
    metric: str
    value: float  # the probe's metric after the step as recorded
    before: float | None
    units: list[Unit]

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _decode(tokenizer: Any, ids: Sequence[int]) -> str:
    return tokenizer.decode(list(ids), skip_special_tokens=True) if tokenizer is not None else ""


def _push(condition: Condition, base: float, without: float) -> float:
    if condition.sign == 0:
        return abs(base - without)
    return condition.sign * (base - without)


def attribute(
    rebuilder: Rebuilder,
    step: int,
    probe: Probe,
    condition: Condition,
    slices: int = 8,
    before: float | None = None,
) -> Attribution:
    """Rank the groups (or slices) of ``step`` by their push towards ``condition``."""
    base_change = LeaveOutGroup(None)
    module = rebuilder.at(max(step - 1, 0))  # (keeps the state before the step)
    grpo = isinstance(module, RolloutModule)
    del module
    log.info("attribute step %d: the step as recorded", step)
    if grpo:
        module = rebuilder.variant(step, lambda: base_change)
    else:
        module = rebuilder.variant(step, lambda: LeaveOutSlice(None, slices))
    tok = rebuilder.tokenizer
    metrics = probe(module, tok)
    key = condition.key(metrics)
    base = metrics[key]
    units: list[Unit] = []
    if grpo:
        taken = base_change.source.taken if base_change.source is not None else None
        if taken is None:
            raise ReplayError(f"step {step}: no rollouts were taken")
        size = base_change.source.size
        count = len(taken.completions) // size
        for g in range(count):
            log.info("attribute step %d: without group %d of %d", step, g + 1, count)
            m = probe(rebuilder.variant(step, lambda g=g: LeaveOutGroup(g)), tok)[key]
            rows = range(g * size, (g + 1) * size)
            units.append(
                Unit(
                    index=g,
                    push=_push(condition, base, m),
                    metric_without=m,
                    prompt=_decode(tok, taken.prompts[g * size]),
                    completions=[
                        {
                            "text": _decode(tok, taken.completions[i]),
                            "reward": float(taken.rewards[i]),
                            "advantage": float(base_change.advantages[i])
                            if i < len(base_change.advantages)
                            else float("nan"),
                        }
                        for i in rows
                    ],
                )
            )
    else:
        ids = list(rebuilder.ledger.step(step)["sample_ids"])
        micro = max(int(rebuilder.meta.get("accumulate_grad_batches", 1)), 1)
        per = max(len(ids) // micro, 1)
        slices = max(1, min(int(slices), per))
        for j in range(slices):
            log.info("attribute step %d: without slice %d of %d", step, j + 1, slices)
            m = probe(rebuilder.variant(step, lambda j=j: LeaveOutSlice(j, slices)), tok)[key]
            mine = [ids[i] for i in range(len(ids)) if (i % per) * slices // per == j]
            units.append(
                Unit(index=j, push=_push(condition, base, m), metric_without=m, sample_ids=mine)
            )
    units.sort(key=lambda u: -u.push)
    for rank, unit in enumerate(units, 1):
        unit.rank = rank
    return Attribution(step, "group" if grpo else "slice", key, base, before, units)


def format_attribution(result: Attribution, top: int = 5, chars: int = 80) -> str:
    """The ranked units as a table, with the top ones' text."""
    lines = [
        f"step {result.step}: {result.metric} = {result.value:.6g} after the step"
        + (f" ({result.before:.6g} before)" if result.before is not None else ""),
        f"{'rank':>4}  {result.kind:>5}  {'push':>10}  {'without it':>10}  what",
    ]
    for u in result.units:
        if u.completions:
            rewards = ", ".join(f"{c['reward']:.3g}" for c in u.completions)
            what = f"{u.prompt[:chars]!r} rewards [{rewards}]"
        else:
            what = f"samples {u.sample_ids[:8]}{' ...' if len(u.sample_ids) > 8 else ''}"
        lines.append(
            f"{u.rank:>4}  {u.index:>5}  {u.push:>10.4g}  {u.metric_without:>10.4g}  {what}"
        )
    for u in result.units[:top]:
        for c in u.completions[:4]:
            lines.append(
                f"  #{u.rank} reward {c['reward']:.3g} adv {c['advantage']:.3g}: "
                f"{c['text'][:chars]!r}"
            )
    return "\n".join(lines)
