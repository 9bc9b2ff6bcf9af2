"""Admission: can a request ever run on this engine, and which waiting requests start now.

`prompt_problem` is the one prompt check every caller goes through: the HTTP server, batch
generation, evaluation and offline use all reach it through `InferenceScheduler.problem`,
so what is refused, and the words of the refusal, cannot differ between them.

`Admission` is the scheduler's admission step: waiting requests take a request row, the KV
of their prompt and their adapter's slot. A failure while admitting one request (its
adapter's copy into a slot, a KV call) ends that request alone, `aborted` with the cause:
the other requests and the engine's loop go on.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from astrai.inference.params import SamplingParams
from astrai.inference.priority import SchedulingPolicy
from astrai.inference.processors import describe
from astrai.inference.task import Rejection, Task, TaskState

if TYPE_CHECKING:
    from astrai.inference.adapters import AdapterSlots, NoAdapterSlots
    from astrai.inference.cache import PagePool

logger = logging.getLogger(__name__)


def prompt_problem(
    prompt_ids: Sequence[int],
    params: SamplingParams,
    *,
    vocab_size: int,
    max_seq_len: int,
    max_prompt_tokens: int | None,
    failure: str | None = None,
) -> Rejection | None:
    """Why a request with valid `params` can never run (None: it can).

    `param` tags the setting at fault, for callers that answer in their own field names:
    ``"prompt"`` (empty, longer than the context or than `max_prompt_tokens`, ids outside
    the vocabulary), ``"max_tokens"`` (not positive; or, with `max_tokens_policy="error"`,
    prompt + `max_tokens` beyond the context: with "clamp" generation stops when the context
    is full), ``"prompt_logprobs_start"`` (nothing left to score); None: the engine has
    failed (`failure`).
    """
    n = len(prompt_ids)
    if not n:
        return Rejection("empty prompt", param="prompt")
    scoring = params.prompt_logprobs is not None
    if params.max_tokens < 0 or (params.max_tokens == 0 and not scoring):
        return Rejection(
            f"max_tokens must be positive (0 only with prompt_logprobs), got {params.max_tokens}",
            param="max_tokens",
        )
    too_long = _too_long(n, params.max_tokens, max_seq_len, max_prompt_tokens)
    if too_long is not None:
        return Rejection(too_long, param="prompt", exceeds_context=True)
    if scoring and params.prompt_logprobs_start >= n:
        return Rejection(
            f"prompt_logprobs_start ({params.prompt_logprobs_start}) must be below the "
            f"prompt length ({n}): nothing would be scored",
            param="prompt_logprobs_start",
        )
    bad = [i for i in prompt_ids if not 0 <= i < vocab_size]
    if bad:
        return Rejection(
            f"token id(s) outside the vocabulary [0, {vocab_size}): {bad[:5]}", param="prompt"
        )
    total = n + params.max_tokens
    if params.max_tokens_policy == "error" and total > max_seq_len:
        return Rejection(
            f"this model's maximum context length is {max_seq_len} tokens, but "
            f"{total} were requested ({n} in the prompt + {params.max_tokens} to "
            f"generate); at most {max_seq_len - n} can be generated after this prompt",
            param="max_tokens",
            exceeds_context=True,
        )
    if failure is not None:
        return Rejection(f"engine not ready: {failure}")
    return None


def _too_long(n: int, max_tokens: int, max_seq_len: int, cap: int | None) -> str | None:
    """The context holds the prompt plus at least one generated token (unless
    max_tokens=0: scoring); `max_prompt_tokens` may cap prompts below that."""
    room = max_seq_len - min(max_tokens, 1)
    limit = room if cap is None else min(room, cap)
    if n <= limit:
        return None
    why = (
        "max_prompt_tokens"
        if limit < room
        else f"the context holds {max_seq_len}: the prompt + at least one generated "
        "token, unless max_tokens=0"
    )
    return f"prompt is too long: {n} tokens, the limit is {limit} ({why})"


class Admission:
    """`InferenceScheduler`'s admission of waiting tasks (a mixin over its queues)."""

    pool: PagePool
    adapter_slots: AdapterSlots | NoAdapterSlots
    max_batch_size: int
    max_seq_len: int
    batch_invariant: bool
    scheduling: SchedulingPolicy
    total_prompt_tokens: int
    total_cached_tokens: int
    _waiting: deque[Task]
    _running: list[Task]
    _lock: threading.Lock
    _finish: Callable[..., None]  # (task, reason, error): the scheduler's one way to end a task

    def _refill(self) -> None:
        """Admit waiting tasks while there are request rows and KV for their prompts."""
        admitted: list[Task] = []
        try:
            self._admit(admitted)
        finally:
            if len(admitted) > 1:  # the allocator places the rows of one admission
                rows = [t.row for t in admitted]
                lens = [t.prefill_len for t in admitted]
                for t, row in zip(admitted, self.pool.arrange_rows(rows, lens)):
                    t.row = row

    def _admit(self, admitted: list[Task]) -> None:
        while self._waiting and len(self._running) < self.max_batch_size:
            task = self._next_admissible()
            if task is None:
                return
            try:
                more = self._admit_one(task, admitted)
            except Exception as err:  # this request's fault: end it, admit the others
                logger.exception("admitting request %d failed", task.id)
                with self._lock:
                    if task in self._waiting:
                        self._waiting.remove(task)
                self._finish(task, "aborted", f"the request could not start: {describe(err)}")
                continue
            if not more:
                return

    def _admit_one(self, task: Task, admitted: list[Task]) -> bool:
        """Admit `task` if there is room for it; False: nothing more is admitted this step.
        What it took (a row, KV) is given back if taking its adapter slot raises."""
        ids = task.prefill_ids
        # A preempted task was running: if it can no longer fit, it is aborted.
        failed = "aborted" if task.preemptions else "rejected"
        need = len(ids) + min(task.params.max_tokens, 1)
        if self.batch_invariant:  # its whole context now: never preempted, whose recompute
            # by prefill would give its KV other bits than its decode steps did
            need = max(need, min(len(task.prompt_ids) + task.params.max_tokens, self.max_seq_len))
        if not self.pool.can_hold(need, reserve_pages=len(self._running)):
            if self._running:
                return False
            # nothing will ever free memory for it
            what = "prompt + generated tokens do" if task.recompute else "prompt does"
            self._drop(task, failed, f"KV allocation failed: {what} not fit")
            return True
        # Prompt log-probs from position s need the logits of position s - 1: computed
        # (a preempted task that has sampled has all of its prompt log-probs already).
        p = task.params
        scoring = p.prompt_logprobs is not None and not task.recompute
        alloc = self.pool.alloc_task(
            ids,
            limit=p.prompt_logprobs_start - 1 if scoring else None,
            namespace=task.prefix_namespace,
        )
        if alloc is None:
            return False
        row, cached = alloc
        try:
            if not self.pool.ensure(row, need if self.batch_invariant else len(ids)):
                self.pool.free_task(row)
                if self._running:
                    return False
                self._drop(task, failed, "KV allocation failed")
                return True
            slot = -1 if task.adapter is None else self.adapter_slots.acquire(task.adapter)
        except Exception:
            self.pool.free_task(row)
            raise
        if slot is None:  # every slot busy after all: wait for one
            self.pool.free_task(row)
            return False
        with self._lock:
            self._waiting.remove(task)
            self._running.append(task)
        task.adapter_slot = slot
        task.row = row
        admitted.append(task)
        task.computed = min(cached, len(ids) - 1)
        task.state = TaskState.RUNNING
        if not task.preemptions:  # prompt figures count each request once
            task.cached_tokens = task.computed
            self.total_prompt_tokens += len(task.prompt_ids)
            self.total_cached_tokens += task.computed
        return True

    def _drop(self, task: Task, reason: str, error: str) -> None:
        """End waiting `task`, which can never be admitted."""
        with self._lock:
            self._waiting.remove(task)
        self._finish(task, reason, error)

    def _next_admissible(self) -> Task | None:
        """The first waiting task (in the `scheduling_policy`'s order) whose adapter can have
        a slot now (the base always can); as vLLM, requests whose adapter must wait for a slot
        do not hold up the others."""
        slots = self.adapter_slots
        ready = (t for t in self._waiting if t.adapter is None or slots.available(t.adapter))
        return self.scheduling.first_waiting(ready)
