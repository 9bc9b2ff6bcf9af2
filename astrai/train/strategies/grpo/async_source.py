"""Asynchronous GRPO rollouts: a generator thread samples the next generation batches while
the trainer trains on the current one (verl's one-step-off-policy, TRL's async GRPO).

The schedule is fixed, which makes it exact. When the trainer starts generation batch ``n``
(with policy version ``v``, its optimizer-step count), the loader has already shown it the
next ``max_staleness`` batches (``LMModule.batch_lookahead``); any of them not yet queued is
queued now with a snapshot of version ``v``'s weights. Batch ``n + K`` is therefore always
sampled by the weights that started batch ``n``: its staleness is fixed by the data order and
``K``, never by thread timing (a batch the loader could not show in time, at an epoch's
start, is sampled then, synchronously). The generator owns a copy of the policy that weights
reach through the engine's versioned update, a state-dict copy in memory, no file. A
checkpoint waits for the queued batches and carries their samples, so a resumed run trains on
exactly what the uninterrupted one did. ``max_staleness: 0`` runs every batch on the thread,
waited for at once: bit for bit the synchronous run.

Samples older than the weights that train on them are corrected as TRL corrects vLLM's: the
ratio's denominator becomes the log-probs of the policy at the generation's first use
(computed then, as TRL computes ``old_per_token_logps``), and the policy term is weighted by
the truncated importance ratio towards the sampling policy
(:func:`~astrai.train.strategies.grpo.loss.importance_sampling_ratio`).
"""

from __future__ import annotations

import copy
import logging
import queue
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from astrai.train.strategies.grpo.generation import Generation, Rollouts
from astrai.train.strategies.grpo.loss import IS_CORRECTIONS, importance_sampling_ratio
from astrai.train.strategies.grpo.sampling import Samples
from astrai.train.strategies.grpo.source import RolloutSource

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class AsyncRollouts:
    """``strategy.async_rollouts``: ``max_staleness`` (K, generation batches sampled ahead),
    ``importance_sampling_correction`` (TRL's ``vllm_importance_sampling_mode`` values, or
    ``none``), ``importance_sampling_clip_min`` / ``_clip_max`` (TRL's ``C_min`` / ``C_max``),
    ``generator_threads`` (torch threads of the generator; None: the trainer's count)."""

    max_staleness: int = 1
    importance_sampling_correction: str = "token_truncate"
    importance_sampling_clip_min: float | None = None
    importance_sampling_clip_max: float | None = 3.0
    generator_threads: int | None = None

    @classmethod
    def parse(cls, spec: Any) -> AsyncRollouts | None:
        """None / false: synchronous; a mapping: checked, every error naming its key."""
        if spec is None or spec is False:
            return None
        if not isinstance(spec, Mapping):
            raise ValueError(
                f"GRPO async_rollouts must be a mapping like {{max_staleness: 1}} or null, "
                f"got {spec!r}"
            )
        unknown = set(spec) - set(cls.__dataclass_fields__)
        if unknown:
            raise ValueError(
                f"GRPO async_rollouts: unknown key(s) {sorted(unknown)}; known: "
                f"{sorted(cls.__dataclass_fields__)}"
            )
        out = cls(**dict(spec))
        k = out.max_staleness
        if isinstance(k, bool) or not isinstance(k, int) or k < 0:
            raise ValueError(f"GRPO async_rollouts.max_staleness must be an int >= 0, got {k!r}")
        mode = out.importance_sampling_correction
        if mode not in (*IS_CORRECTIONS, "none"):
            raise ValueError(
                f"GRPO async_rollouts.importance_sampling_correction must be one of "
                f"{(*IS_CORRECTIONS, 'none')}, got {mode!r}"
            )
        low, high = out.importance_sampling_clip_min, out.importance_sampling_clip_max
        for name, value in (("clip_min", low), ("clip_max", high)):
            if value is not None and not float(value) >= 0:
                raise ValueError(
                    f"GRPO async_rollouts.importance_sampling_{name} must be >= 0 or null, "
                    f"got {value!r}"
                )
        if low is not None and high is not None and float(low) > float(high):
            raise ValueError(
                "GRPO async_rollouts: importance_sampling_clip_min must be <= "
                f"importance_sampling_clip_max, got {low} > {high}"
            )
        threads = out.generator_threads
        if threads is not None and (isinstance(threads, bool) or int(threads) < 1):
            raise ValueError(
                f"GRPO async_rollouts.generator_threads must be >= 1 or null, got {threads!r}"
            )
        return out


def weight_snapshot(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """A copy of the weights as they are now (the trainer goes on changing its own)."""
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def policy_copy(model: torch.nn.Module) -> torch.nn.Module:
    """The generator's own policy: the trainer's module, copied, without gradients."""
    clone = copy.deepcopy(model)
    clone.requires_grad_(False)
    return clone


class RolloutWorker:
    """One thread that runs rollout jobs in submission order on the generator's engine.

    A job is ``(version, snapshot, fn)``: before ``fn()`` runs, a snapshot's weights are
    loaded into the generator's model through the engine's versioned update (which also
    drops the prefix-cache pages of the old weights; in server mode, the engine pushes
    them to the replicas). ``engine``: a ``PolicyEngine`` or a ``RemotePolicy``. Results and exceptions come back
    through the ``Future`` :meth:`submit` returns.
    """

    def __init__(self, engine: Any, model: Any, threads: int | None = None) -> None:
        self.engine = engine
        self.model = model
        self.threads = threads if threads is not None else torch.get_num_threads()
        self.jobs: queue.Queue[Any] = queue.Queue()
        self.thread = threading.Thread(target=self._run, name="grpo-rollouts", daemon=True)
        self.thread.start()

    def submit(
        self, version: int, snapshot: dict[str, torch.Tensor] | None, fn: Callable[[], Any]
    ) -> Future:
        future: Future = Future()
        self.jobs.put((version, snapshot, fn, future))
        return future

    def _run(self) -> None:
        torch.set_num_threads(int(self.threads))
        while True:
            job = self.jobs.get()
            if job is None:
                return
            version, snapshot, fn, future = job
            if not future.set_running_or_notify_cancel():
                continue
            try:
                if snapshot is not None:
                    self.engine.sync(version, lambda s=snapshot: self.model.load_state_dict(s))
                future.set_result(fn())
            except BaseException as err:  # the trainer re-raises it where it waits
                future.set_exception(err)

    def close(self) -> None:
        self.jobs.put(None)
        self.thread.join(timeout=60)
        if self.thread.is_alive():
            log.warning("GRPO: the rollout thread did not stop within 60 s")
        self.engine.close()


def batch_key(prompt_ids: Sequence[Sequence[int]]) -> tuple:
    """A loader batch's identity: its prompts."""
    return tuple(tuple(int(t) for t in p) for p in prompt_ids)


Job = Callable[[Mapping[str, Any], int], Callable[[], Samples]]


class RolloutQueue:
    """The generator thread (started by ``start`` on first use) and the loader batches queued
    on it, by their prompts: ``(seed, future)``."""

    def __init__(self, start: Callable[[], RolloutWorker]) -> None:
        self.start = start
        self.worker: RolloutWorker | None = None
        self.pending: dict[tuple, tuple[int, Future]] = {}
        self.sent_version: int | None = None  # the last version whose weights went out

    def submit(self, model: torch.nn.Module, version: int, fn: Callable[[], Any]) -> Future:
        """Queue ``fn()`` with the weights as they are now (a snapshot goes with the
        first job of each policy version; the worker's copy starts as the weights now)."""
        if self.worker is None:
            self.worker, self.sent_version = self.start(), version
        snapshot = None
        if version != self.sent_version:
            snapshot, self.sent_version = weight_snapshot(model), version
        return self.worker.submit(version, snapshot, fn)

    def take(
        self,
        batch: Mapping[str, Any],
        seed: int,
        upcoming: Sequence[tuple[Mapping[str, Any], int]],
        job: Job,
        model: torch.nn.Module,
        version: int,
    ) -> Future:
        """``batch``'s rollouts (queued earlier, or now), after queueing those of the
        ``upcoming`` batches (with their seeds) not queued yet: the fixed schedule above."""
        entry = self.pending.pop(batch_key(batch["prompt_ids"]), None)
        if entry is not None and entry[0] != seed:
            log.warning("GRPO: queued rollouts were seeded for another step; sampling again")
            entry = None
        if entry is None:
            entry = (seed, self.submit(model, version, job(batch, seed)))
        keep = set()
        for later, later_seed in upcoming:
            key = batch_key(later["prompt_ids"])
            keep.add(key)
            if key not in self.pending:
                self.pending[key] = (
                    later_seed,
                    self.submit(model, version, job(later, later_seed)),
                )
        for stale in set(self.pending) - keep:  # the loader will not hand these over
            self.pending.pop(stale)[1].cancel()
        return entry[1]

    def state_dict(self) -> list[dict[str, Any]]:
        """The queued batches' samples (waiting for them): what a resumed run trains on."""
        return [
            {"prompt_ids": [list(p) for p in key], "seed": seed, "samples": f.result().state_dict()}
            for key, (seed, f) in self.pending.items()
        ]

    def load_state_dict(self, entries: Sequence[Mapping[str, Any]]) -> None:
        self.pending = {}
        for entry in entries:
            done: Future = Future()
            done.set_result(Samples.from_state(entry["samples"]))
            self.pending[batch_key(entry["prompt_ids"])] = (int(entry["seed"]), done)

    def close(self) -> None:
        for _, future in self.pending.values():
            future.cancel()
        if self.worker is not None:
            self.worker.close()
            self.worker = None


class Staleness:
    """The run's histogram of generation staleness (optimizer steps between the weights that
    sampled a generation batch and those that first train on it)."""

    def __init__(self) -> None:
        self.counts: dict[int, int] = {}

    def record(self, gap: int) -> dict[str, float]:
        """Count a generation's staleness; the metrics: it, and the run's histogram."""
        self.counts[gap] = self.counts.get(gap, 0) + 1
        total = sum(self.counts.values())
        out = {"async/staleness": float(gap)}
        out.update({f"async/staleness_frac/{k}": c / total for k, c in sorted(self.counts.items())})
        return out


class AsyncSource(RolloutSource):
    """Asynchronous rollouts: the schedule above, over a source that ``build(model)`` makes
    on the generator's own copy of the policy (an engine source on its own engine).

    Args:
        options: ``strategy.async_rollouts``.
        policy: the trainer's live policy (copied when the generator starts; its weights are
            snapshot for every new policy version).
        build: ``build(copy) -> (source, engine)``: the generator's source and the engine it
            samples on (whose weights the versioned updates load).
        weights: ``weights(policy)``: what the snapshots load into (``load_state_dict``):
            a copy of the policy (colocated), or in server mode a holder of the snapshot
            that the engine pushes to the replicas (``rollout_mode.SnapshotWeights``).
        seed_of: ``seed_of(batch, ahead)``: the rollout seed of the loader batch ``ahead``
            generation batches on.
    """

    def __init__(
        self,
        options: AsyncRollouts,
        policy: torch.nn.Module,
        build: Callable[[Any], tuple[RolloutSource, Any]],
        seed_of: Callable[[Mapping[str, Any], int], int],
        weights: Callable[[torch.nn.Module], Any] = policy_copy,
    ) -> None:
        self.options = options
        self.policy = policy
        self.build = build
        self.seed_of = seed_of
        self.weights = weights
        self.step = 0
        self.inner: RolloutSource | None = None
        self.queue = RolloutQueue(self._start)

    def _start(self) -> RolloutWorker:
        """The generator thread, its engine on a copy of the policy as it is now (in
        server mode: the replicas, fed from the snapshots)."""
        model = self.weights(self.policy)
        self.inner, engine = self.build(model)
        engine.sync(self.step)
        return RolloutWorker(engine, model, self.options.generator_threads)

    def _job(self, batch: Mapping[str, Any], seed: int) -> Callable[[], Samples]:
        part = {"prompt_ids": [list(p) for p in batch["prompt_ids"]], "records": batch["records"]}
        step = self.step
        return lambda: self.inner.take(part, seed, step)

    def take(self, batch: Mapping[str, Any], seed: int, step: int) -> Samples:
        """This batch's rollouts from the generator, after queueing the next ones the loader
        showed (``batch["upcoming"]``)."""
        self.step = int(step)
        upcoming = list(batch.get("upcoming") or [])[: self.options.max_staleness]
        later = [(b, self.seed_of(b, ahead)) for ahead, b in enumerate(upcoming, start=1)]
        future = self.queue.take(batch, seed, later, self._job, self.policy, self.step)
        started = time.perf_counter()
        samples = future.result()
        self.waited = time.perf_counter() - started
        return samples

    def state_dict(self) -> dict[str, Any]:
        """``grpo_pending``: the queued batches' samples (waiting for them), when any."""
        return {"grpo_pending": self.queue.state_dict()} if self.queue.pending else {}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.queue.load_state_dict(state.get("grpo_pending", []))

    def close(self) -> None:
        self.queue.close()


@torch.no_grad()
def correct_staleness(
    generation: Generation,
    options: AsyncRollouts,
    logp_of: Callable[[Rollouts], Tensor],
    *,
    pad_id: int,
    device: torch.device,
) -> dict[str, float]:
    """A generation sampled by an older policy than the one about to train on it: the
    ratio's denominator becomes this policy's log-probs (``logp_of``: one no-gradient forward
    per slice), and the policy term is weighted by the importance ratio towards the sampler
    (:func:`~astrai.train.strategies.grpo.loss.importance_sampling_ratio`). Returns the
    ratio's metrics."""
    old_rows: list[list[float]] = []
    weights: list[Any] = []
    ratios = []
    for index, (start, end) in enumerate(generation.bounds):
        rows = range(start, end)
        # before old_logprobs is set, a slice's old_logp are the behaviour log-probs
        r = generation.slice(index, pad_id=pad_id, device=device, mask_truncated=False).rollouts
        old = logp_of(r).float()
        ratio = importance_sampling_ratio(
            old,
            r.old_logp,
            r.mask,
            mode=options.importance_sampling_correction,
            clip_min=options.importance_sampling_clip_min,
            clip_max=options.importance_sampling_clip_max,
        )
        per_sequence = ratio.shape[-1] == 1
        ratios.append(ratio.flatten() if per_sequence else ratio[r.mask.bool()])
        for row, i in enumerate(rows):
            first, count = len(generation.prompts[i]) - 1, len(generation.completions[i])
            old_rows.append(old[row, first : first + count].tolist())
            weights.append(
                float(ratio[row, 0]) if per_sequence else ratio[row, first : first + count].tolist()
            )
    generation.old_logprobs = old_rows
    generation.is_weights = weights
    flat = torch.cat(ratios) if ratios else torch.ones(1)
    return {
        "async/is_ratio_mean": flat.mean().item(),
        "async/is_ratio_min": flat.min().item(),
        "async/is_ratio_max": flat.max().item(),
    }
