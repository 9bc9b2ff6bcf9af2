"""DAPO's dynamic sampling (Yu et al. 2025; verl's ``algorithm.filter_groups``): groups whose
metric has no variance carry no signal under group-relative advantages, so they are dropped
and more prompts are sampled until the batch holds as many groups as the loader batch.

:class:`DynamicSamplingSource` wraps the module's source, so the step ledger
(``RecordingSource``) records the final samples and a replay (``ReplaySource``) replays
them. Per take: the queued groups (kept groups beyond an earlier batch) come first, then the
loader batch's own groups with variance, then those of extra generation batches: each of
``len(batch)`` prompts drawn from the training prompt set (:func:`draw_prompts`) with a seed
derived from the batch's (:func:`extra_seed`), so a resumed run and an uninterrupted one
sample the same. Kept groups beyond the batch are queued for the next take (at most a batch
less one: the queue is always used up by the next take) and travel in the checkpoint
(``grpo_dynamic_sampling``, one entry per rank). Unlike verl, which drops them, they train
one generation batch later; the ratio's denominator stays their sampler's log-probs, so
PPO's clip bounds that step off-policy. At ``max_num_gen_batches`` generation batches (the
loader batch's included, verl's count), ``at_cap: fill`` tops the batch up with zero-variance
groups (``dynamic_sampling/hit_cap`` is 1), ``raise`` stops the run (verl's behaviour).

Every rank fills its own batch: ranks may sample different numbers of generation batches.
Nothing in between is a collective: the engine's weight refresh (``PolicyEngine.sync``, a
gather under FSDP2) happens at most once per policy version, at the loader batch's
generation (or the ``join`` after each step), which every rank reaches together; the extra
batches sync at the same version, a no-op. The one collective is the agreement after the
loop (``any_rank``), so a ``raise`` stops every rank, not one while the others wait.
Asynchronous rollouts are refused: their generator samples the loader's upcoming batches
ahead, which an extra generation batch would cancel.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from astrai.train.strategies.grpo.sampling import Samples
from astrai.train.strategies.grpo.source import RolloutSource

log = logging.getLogger(__name__)

#: the checkpoint's top-level key: every rank's queued groups
CHECKPOINT_KEY = "grpo_dynamic_sampling"
AT_CAP = ("fill", "raise")
#: generation batches of one take after which an uncapped run warns (once)
WARN_AFTER = 100


@dataclass(frozen=True)
class DynamicSampling:
    """``strategy.dynamic_sampling`` (verl's ``algorithm.filter_groups``): ``metric`` (whose
    group variance decides: ``reward``, the weighted total, or a reward's name: its
    unweighted column), ``max_num_gen_batches`` (generation batches per take at most; 0: no
    cap) and ``at_cap`` (``fill``: top up with zero-variance groups; ``raise``: stop)."""

    metric: str = "reward"
    max_num_gen_batches: int = 0
    at_cap: str = "fill"

    @classmethod
    def parse(
        cls, spec: Any, *, reward_names: Sequence[str], async_rollouts: bool = False
    ) -> DynamicSampling | None:
        """None / false: off; a mapping: checked, every error naming its key.
        ``reward_names``: the columns a metric may name (the rewards', ``environment``)."""
        if spec is None or spec is False:
            return None
        key = "GRPO strategy.dynamic_sampling"
        if not isinstance(spec, Mapping):
            raise ValueError(
                f"{key} must be a mapping like {{metric: reward, max_num_gen_batches: 10, "
                f"at_cap: fill}} or null, got {spec!r}"
            )
        unknown = set(spec) - set(cls.__dataclass_fields__)
        if unknown:
            raise ValueError(
                f"{key}: unknown key(s) {sorted(unknown)}; known: "
                f"{sorted(cls.__dataclass_fields__)}"
            )
        out = cls(**dict(spec))
        names = ["reward", *reward_names]
        if out.metric not in names:
            raise ValueError(f"{key}.metric must be one of {names}, got {out.metric!r}")
        cap = out.max_num_gen_batches
        if isinstance(cap, bool) or not isinstance(cap, int) or cap < 0:
            raise ValueError(
                f"{key}.max_num_gen_batches must be an int >= 0 (0: no cap), got {cap!r}"
            )
        if out.at_cap not in AT_CAP:
            raise ValueError(f"{key}.at_cap must be one of {AT_CAP}, got {out.at_cap!r}")
        if async_rollouts:
            raise ValueError(
                f"{key} with strategy.async_rollouts: not supported (the generator samples "
                "the loader's next batches ahead; extra generation batches would cancel "
                "them); set one of them to null"
            )
        return out


# ---------------------------------------------------------------------- groups
def metric_values(samples: Samples, metric: str) -> list[float]:
    """The filter's metric per completion: the total reward or one reward's column."""
    if metric == "reward":
        return list(samples.rewards)
    if metric not in samples.reward_columns:
        raise RuntimeError(
            f"GRPO dynamic_sampling.metric={metric!r}: the samples have no such reward column "
            f"(they have {sorted(samples.reward_columns)})"
        )
    return list(samples.reward_columns[metric])


def zero_variance(values: Sequence[float], group: int) -> list[bool]:
    """Per group of ``group`` consecutive values: whether their std is 0 (in float32, as
    the generation's ``zero_var_frac`` counts them)."""
    if len(values) % group:
        raise ValueError(f"{len(values)} values are not groups of {group}")
    stds = torch.tensor(list(values), dtype=torch.float32).view(-1, group).std(dim=1)
    return (stds == 0).tolist()


def split_groups(samples: Samples, group: int) -> list[Samples]:
    """``samples`` as one :class:`Samples` per group (``parts``: the group's means)."""
    out = []
    for start in range(0, len(samples.completions), group):
        rows = slice(start, start + group)
        columns = {k: list(v[rows]) for k, v in samples.reward_columns.items()}
        parts = {
            k: sum(columns[k]) / group if k in columns else v for k, v in samples.parts.items()
        }
        masks = samples.action_masks
        out.append(
            Samples(
                prompts=samples.prompts[rows],
                completions=samples.completions[rows],
                logprobs=samples.logprobs[rows],
                truncated=samples.truncated[rows],
                rewards=samples.rewards[rows],
                parts=parts,
                action_masks=None if masks is None else masks[rows],
                version=samples.version,
                reward_columns=columns,
            )
        )
    return out


def join_groups(groups: Sequence[Samples], stats: Mapping[str, float]) -> Samples:
    """One :class:`Samples` of ``groups`` in order: ``parts`` the means over all of them,
    ``version`` the oldest sampler's, ``stats`` as given."""
    rows = [len(g.completions) for g in groups]
    total = sum(rows)
    parts = {k: sum(g.parts[k] * n for g, n in zip(groups, rows)) / total for k in groups[0].parts}
    masked = groups[0].action_masks is not None
    return Samples(
        prompts=[p for g in groups for p in g.prompts],
        completions=[c for g in groups for c in g.completions],
        logprobs=[lp for g in groups for lp in g.logprobs],
        truncated=[t for g in groups for t in g.truncated],
        rewards=[r for g in groups for r in g.rewards],
        parts=parts,
        action_masks=[m for g in groups for m in g.action_masks] if masked else None,
        stats=dict(stats),
        version=min(g.version for g in groups),
        reward_columns={
            k: [v for g in groups for v in g.reward_columns[k]] for k in groups[0].reward_columns
        },
    )


# ---------------------------------------------------------------------- prompts
def extra_seed(seed: int, index: int) -> int:
    """The seed of extra generation batch ``index`` (1, 2, ...) of the batch seeded ``seed``:
    a 63-bit hash, apart from the loader batches' seeds (``rollout_seed`` + counts)."""
    key = f"dynamic_sampling:{int(seed)}:{int(index)}".encode()
    return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little") >> 1


def draw_prompts(loader: Any, seed: int, count: int) -> dict[str, Any]:
    """``count`` prompts of the training loader's dataset, drawn with ``seed`` (without
    replacement when it has that many) and collated by the loader's ``collate_fn``: a
    loader batch of other prompts. Neither the global RNG nor the loader moves."""
    dataset = loader.dataset
    size = len(dataset)
    generator = torch.Generator().manual_seed(int(seed))
    if count <= size:
        index = torch.randperm(size, generator=generator)[:count]
    else:
        index = torch.randint(size, (count,), generator=generator)
    return loader.collate_fn([dataset[int(i)] for i in index])


# ---------------------------------------------------------------------- the source
class DynamicSamplingSource(RolloutSource):
    """``inner``'s samples with zero-variance groups filtered out (the module docstring).

    Args:
        inner: the module's source (the engine source).
        options: ``strategy.dynamic_sampling``.
        group: completions per prompt (``num_generations``).
        draw: ``draw(seed, count)``: a collated batch of ``count`` training prompts
            (:func:`draw_prompts` on the trainer's loader).
        over_ranks: every rank's value of its argument, in rank order (a collective; one
            process: ``[value]``): the checkpoint's queues.
        rank: ``(rank, world_size)`` now.
        any_rank: whether any rank passes True (a collective; one process: the flag).
    """

    def __init__(
        self,
        inner: RolloutSource,
        options: DynamicSampling,
        group: int,
        draw: Callable[[int, int], Mapping[str, Any]],
        *,
        over_ranks: Callable[[Any], list[Any]] = lambda value: [value],
        rank: Callable[[], tuple[int, int]] = lambda: (0, 1),
        any_rank: Callable[[bool], bool] = bool,
    ) -> None:
        self.inner = inner
        self.options = options
        self.group = int(group)
        self.draw = draw
        self.over_ranks = over_ranks
        self.rank = rank
        self.any_rank = any_rank
        self.queue: list[Samples] = []
        self.warned = False

    def take(self, batch: Mapping[str, Any], seed: int, step: int) -> Samples:
        need = len(batch["prompt_ids"])
        kept, self.queue = list(self.queue), []
        dropped: list[Samples] = []
        cap, waited = self.options.max_num_gen_batches, 0.0
        gen_batches = generated = zero = 0
        stats: dict[str, float] = {}
        current, current_seed = batch, seed
        hit_cap = short = False
        varied = 0
        while True:
            samples = self.inner.take(current, current_seed, step)
            waited += self.inner.waited
            gen_batches += 1
            if gen_batches == 1:
                stats = dict(samples.stats)  # the loader batch's own (episodes)
            flat = zero_variance(metric_values(samples, self.options.metric), self.group)
            for part, is_flat in zip(split_groups(samples, self.group), flat):
                (dropped if is_flat else kept).append(part)
            generated, zero = generated + len(flat), zero + sum(flat)
            if len(kept) >= need:
                break
            if cap and gen_batches >= cap:
                hit_cap, varied = True, len(kept)
                short = self.options.at_cap == "raise"
                if not short:
                    kept += dropped[: need - len(kept)]
                break
            if gen_batches == WARN_AFTER and not self.warned:
                self.warned = True
                log.warning(
                    "GRPO dynamic_sampling: %d generation batches for one batch and still "
                    "%d of %d groups with %s variance (max_num_gen_batches=0: no cap)",
                    gen_batches,
                    len(kept),
                    need,
                    self.options.metric,
                )
            current_seed = extra_seed(seed, gen_batches)
            current = self.draw(current_seed, need)
        self.waited = waited
        if self.any_rank(short):  # every rank stops, not one while the others wait
            raise RuntimeError(
                f"GRPO dynamic_sampling: max_num_gen_batches={cap} generation batches reached "
                f"with too few groups whose {self.options.metric!r} varies (this rank: "
                f"{varied if short else 'enough'} of {need}; at_cap=raise, verl's 'Generated "
                "too many. Please check your data.'); raise max_num_gen_batches (0: no cap), "
                "set at_cap=fill, or check the reward"
            )
        if hit_cap and not self.warned:
            self.warned = True
            log.warning(
                "GRPO dynamic_sampling: max_num_gen_batches=%d reached; the batch was topped "
                "up with zero-variance groups (at_cap=fill; counted in dynamic_sampling/hit_cap)",
                cap,
            )
        self.queue = kept[need:]
        stats.update(
            {
                "dynamic_sampling/zero_var_frac_before": zero / generated,
                "dynamic_sampling/gen_batches": float(gen_batches),
                "dynamic_sampling/hit_cap": float(hit_cap),
                "dynamic_sampling/queued": float(len(self.queue)),
            }
        )
        return join_groups(kept[:need], stats)

    # ------------------------------------------------------------------ checkpoint
    def state_dict(self) -> dict[str, Any]:
        """The inner source's entries and ``grpo_dynamic_sampling``: every rank's queued
        groups (a collective: a checkpoint is written by rank 0)."""
        mine = [g.state_dict() for g in self.queue]
        return {**self.inner.state_dict(), CHECKPOINT_KEY: self.over_ranks(mine)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.inner.load_state_dict(state)
        saved = state.get(CHECKPOINT_KEY)
        self.queue = []
        if not saved:
            return
        rank, world = self.rank()
        if len(saved) != world and any(saved):
            raise RuntimeError(
                f"GRPO dynamic_sampling: the checkpoint holds queued groups of {len(saved)} "
                f"rank(s); it resumes at {len(saved)} rank(s) only (each rank's queue is its "
                "own samples)"
            )
        if rank < len(saved):
            self.queue = [Samples.from_state(g) for g in saved[rank]]

    def close(self) -> None:
        self.inner.close()
