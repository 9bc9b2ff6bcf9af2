"""Rewards scored concurrently: synchronous rewards on a bounded thread pool, ``async`` ones
(an ``async def``, or a class whose ``__call__`` / ``batch`` is ``async``) on one event loop
on a daemon thread (TRL's ``start_event_loop_in_daemon``), each prompt's group as soon as its
``G`` completions are finished, while the engine generates the others.

A reward that raises, returns a non-finite value or runs past its ``timeout`` gives its
``failure_value`` for that completion (or, for a ``batch`` reward, the group) and counts in
``reward/<name>/failures``; its first error is logged once. The values land in the order a
serial scoring gives them (the same numbers: each call sees the same record and text).

A timed-out synchronous call cannot be stopped: its thread stays busy until it returns.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import logging
import math
import threading
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch
from torch import Tensor

from astrai.train.strategies.grpo.overlong import NoOverlong, Overlong
from astrai.train.strategies.grpo.rewards import WeightedReward, parse_rewards

logger = logging.getLogger(__name__)

#: the default ``strategy.reward_workers``: synchronous reward calls running at once
DEFAULT_WORKERS = 8

_LOOP: asyncio.AbstractEventLoop | None = None
_LOOP_LOCK = threading.Lock()


def event_loop() -> asyncio.AbstractEventLoop:
    """The process's reward event loop, started once on a daemon thread."""
    global _LOOP
    with _LOOP_LOCK:
        if _LOOP is None:
            loop = asyncio.new_event_loop()
            threading.Thread(
                target=loop.run_forever, name="astrai-reward-loop", daemon=True
            ).start()
            _LOOP = loop
        return _LOOP


def is_async(fn: Callable[..., Any]) -> bool:
    """A coroutine function, or an object whose ``__call__`` is one."""
    if inspect.iscoroutinefunction(fn):
        return True
    if inspect.isroutine(fn) or isinstance(fn, functools.partial):
        return False
    return inspect.iscoroutinefunction(type(fn).__call__)


def _batch_of(fn: Any) -> Callable[..., Any] | None:
    batch = getattr(fn, "batch", None)  # the reward protocol's optional method
    return batch if callable(batch) else None


#: a job's outcome: its values, how many failed, the first error (None: none)
Outcome = tuple[list[float], int, str | None]


def _finite(item: WeightedReward, raw: Sequence[Any]) -> Outcome:
    values, failed, error = [], 0, None
    for v in raw:
        try:
            value = float(v)
        except (TypeError, ValueError):
            value = math.nan
        if not math.isfinite(value):
            failed += 1
            error = error or f"returned {v!r}, not a finite number"
            value = item.failure_value
        values.append(value)
    return values, failed, error


class RewardPool:
    """Scores completions with ``rewards`` (:func:`parse_rewards`' items), ``workers``
    synchronous calls at a time (1: serially), plus the ``overlong`` column when on."""

    def __init__(
        self,
        rewards: Sequence[Any],
        workers: int = DEFAULT_WORKERS,
        overlong: Overlong | None = None,
    ) -> None:
        self.rewards: list[WeightedReward] = (
            parse_rewards(rewards, where="rewards") if rewards else []
        )
        self.workers = int(workers)
        self.overlong: Overlong = overlong if overlong is not None else NoOverlong()
        self._executor: ThreadPoolExecutor | None = None
        self._semaphore: asyncio.Semaphore | None = None
        self._logged: set[str] = set()

    def __getstate__(self) -> dict[str, Any]:
        return {"rewards": self.rewards, "workers": self.workers, "overlong": self.overlong}

    def __setstate__(self, state: Mapping[str, Any]) -> None:
        self.__init__(state["rewards"], state["workers"], state["overlong"])

    def weighted(self, columns: Mapping[str, Tensor], count: int) -> Tensor:
        """The weighted total per completion ``[count]`` of the columns (rewards, overlong)."""
        total = torch.zeros(count)
        weights = {item.name: item.weight for item in self.rewards}
        weights[self.overlong.name] = self.overlong.weight
        for name, vals in columns.items():
            if name in weights:
                total += weights[name] * vals
        return total

    # ------------------------------------------------------------------ one job
    async def _threaded(self, call: Callable[[], Any], timeout: float | None) -> Any:
        if self._semaphore is None:
            self._semaphore = asyncio.Semaphore(self.workers)
        if self._executor is None:
            self._executor = ThreadPoolExecutor(self.workers, thread_name_prefix="astrai-reward")
        async with self._semaphore:  # the timeout runs from the call's start, not its queueing
            job = asyncio.get_running_loop().run_in_executor(self._executor, call)
            return await asyncio.wait_for(job, timeout)

    async def _job(
        self, item: WeightedReward, call: Callable[[], Any], asynchronous: bool, count: int
    ) -> Outcome:
        try:
            if asynchronous:
                raw = await asyncio.wait_for(call(), item.timeout)
            else:
                raw = await self._threaded(call, item.timeout)
            raw = list(raw) if count > 1 or isinstance(raw, (list, tuple)) else [raw]
            if len(raw) != count:
                raise ValueError(f"returned {len(raw)} values for {count} completions")
        except TimeoutError:
            return [item.failure_value] * count, count, f"timed out after {item.timeout} s"
        except Exception as err:  # a reward's fault is its failure value, never a crash
            return [item.failure_value] * count, count, f"{type(err).__name__}: {err}"
        return _finite(item, raw)

    def submit(
        self, item: WeightedReward, records: Sequence[Mapping[str, Any]], texts: Sequence[str]
    ) -> list[Future[Outcome]]:
        """``item``'s jobs for these completions: one ``batch`` call, or one call each."""
        loop = event_loop()
        batch = _batch_of(item.fn)
        if batch is not None:
            recs, txts = list(records), list(texts)
            job = self._job(item, lambda: batch(recs, txts), is_async(batch), len(txts))
            return [asyncio.run_coroutine_threadsafe(job, loop)]
        asynchronous = is_async(item.fn)
        return [
            asyncio.run_coroutine_threadsafe(
                self._job(item, lambda r=r, t=t: item.fn(r, t), asynchronous, 1), loop
            )
            for r, t in zip(records, texts)
        ]

    def session(self, records: Sequence[Mapping[str, Any]], group: int) -> Scoring:
        """A scoring of ``records`` (one per completion, prompt-major, ``group`` each)."""
        return Scoring(self, records, group)

    def score(
        self,
        records: Sequence[Mapping[str, Any]],
        texts: Sequence[str],
        lengths: Sequence[int] | None = None,
    ) -> tuple[dict[str, Tensor], dict[str, float]]:
        """Every completion at once: (each reward's values by name, its failure counts)."""
        if len(records) != len(texts):
            raise ValueError(f"score: {len(records)} records but {len(texts)} completions")
        scoring = self.session(records, max(len(texts), 1))
        return scoring.finish(texts, lengths)

    def note(self, name: str, error: str) -> None:
        """Log a reward's first failure, once per pool."""
        if name not in self._logged:
            self._logged.add(name)
            logger.warning(
                "reward %r failed (%s); it gives its failure_value, counted in "
                "reward/%s/failures (further failures are not logged)",
                name,
                error,
                name,
            )


class Scoring:
    """One generation batch's scoring: :meth:`group` starts a prompt's group as soon as its
    completions are decoded (the engine's ``on_group`` hook); :meth:`finish` starts the groups
    not started yet and waits for every value."""

    def __init__(self, pool: RewardPool, records: Sequence[Mapping[str, Any]], group: int):
        self.pool = pool
        self.records = list(records)
        self.size = int(group)
        self.jobs: dict[int, dict[str, list[Future[Outcome]]]] = {}

    def group(self, index: int, texts: Sequence[str]) -> None:
        """Start scoring group ``index`` (its ``G`` texts), once."""
        if index in self.jobs:
            return
        lo = index * self.size
        recs = self.records[lo : lo + len(texts)]
        self.jobs[index] = {
            item.name: self.pool.submit(item, recs, texts) for item in self.pool.rewards
        }

    def finish(
        self, texts: Sequence[str], lengths: Sequence[int] | None = None
    ) -> tuple[dict[str, Tensor], dict[str, float]]:
        """Each reward's values ``[N]`` by name (serial order; with the completions' token
        ``lengths``, the ``overlong`` column when on), and ``reward/<name>/failures``."""
        for index in range(math.ceil(len(texts) / self.size) if texts else 0):
            self.group(index, texts[index * self.size : (index + 1) * self.size])
        columns: dict[str, Tensor] = {}
        failures: dict[str, float] = {}
        for item in self.pool.rewards:
            values: list[float] = []
            failed = 0
            for index in sorted(self.jobs):
                for future in self.jobs[index][item.name]:
                    vals, bad, error = future.result()
                    values.extend(vals)
                    failed += bad
                    if error is not None:
                        self.pool.note(item.name, error)
            columns[item.name] = torch.tensor(values, dtype=torch.float32)
            failures[f"reward/{item.name}/failures"] = float(failed)
        if lengths is not None:
            for name, vals in self.pool.overlong.column(lengths).items():
                columns[name] = torch.tensor(vals, dtype=torch.float32)
        return columns, failures


def score_columns(
    records: Sequence[Mapping[str, Any]],
    texts: Sequence[str],
    rewards: Sequence[Any] | RewardPool,
) -> dict[str, Tensor]:
    """Each reward's unweighted values per completion ``[N]``, by its name (what GDPO's
    per-reward normalisation and dynamic sampling's per-reward metric read); a failed call
    gives its ``failure_value``. ``rewards``: a pool, or what :func:`parse_rewards` takes."""
    return reward_pool(rewards).score(records, texts)[0]


def score(
    records: Sequence[Mapping[str, Any]],
    texts: Sequence[str],
    rewards: Sequence[Any] | RewardPool,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Weighted sum of the rewards per completion ``[N]``, and each reward's mean."""
    pool = reward_pool(rewards)
    columns = pool.score(records, texts)[0]
    return pool.weighted(columns, len(texts)), {k: v.mean() for k, v in columns.items()}


def reward_pool(rewards: Sequence[Any] | RewardPool) -> RewardPool:
    """``rewards`` as a pool (a pool as it is; a list parsed, default workers)."""
    return rewards if isinstance(rewards, RewardPool) else RewardPool(rewards)
