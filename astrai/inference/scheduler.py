"""Continuous batching decisions: queues, admission, KV reservation, step plans, finishing.

The scheduler only decides; it never touches the model, the workspace, graphs or
sampling (that is `runner.ModelRunner`). One engine step is

    plans = scheduler.schedule()          # cleanup, admission, which rows run with what
    out = runner.run(plan)                # for each plan: forward + sampling: a StepOutput,
                                          # the tokens each row emitted (1; 1..k+1 speculating)
    scheduler.postprocess(plan, out)      # append, stop rules, finish
    scheduler.cleanup()                   # free the KV of finished tasks

and both the engine's background loop and its synchronous `run_batch()` drive exactly that
step, so the two paths cannot drift apart. A step packs every active request into one
ragged forward: decode rows (one token each) always run, prefill rows take chunks from a
per-step token budget, so a long prompt never stalls decoding. Tasks are planned in groups
by the attention backend their submitter chose (`attn_backend(...)` is per thread).

When the paged KV pool runs out while decoding, the newest running request is preempted
(vLLM's recompute preemption): its complete pages go to the prefix cache, its KV is freed,
and it goes back to the front of the waiting queue with its generated tokens; re-admitted,
it prefills prompt + generated tokens (mostly prefix-cache hits) and samples on, so its
stream has no gap or repeat. Only a request that cannot fit alone is aborted. With
`scheduling_policy="priority"` the waiting queue is read in (priority, arrival) order and the
preempted request is the least urgent running one (`astrai.inference.priority`).

A prompt's complete pages enter the prefix cache as soon as its prefill completes. The `n`
samples of one prompt are a group (`submit_group`): with a prefix cache, the followers are
held (`groups.HeldFollowers`) until the leader's prefill completes, then queued first, and
each prefills only the tail after the leader's pages.

With `batch_invariant` a prompt's prefill chunks are fixed by the prompt alone: chunk `k`
covers tokens `[k * max_prefill_tokens, (k + 1) * max_prefill_tokens)`, and a prompt whose
next chunk does not fit in the step's leftover budget waits for the next step instead of
taking a shorter one (the first prefilling request always gets the whole budget, so each
step makes progress). Attention within a chunk depends on the chunk's length. And a
request's whole context (prompt + max_tokens) is reserved at admission, so it is never
preempted (its recompute by prefill would give its KV other bits than its decode steps).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from astrai.inference.adapters import NO_ADAPTER_SLOTS, AdapterSlots, NoAdapterSlots
from astrai.inference.admission import Admission, prompt_problem
from astrai.inference.cache import PagePool
from astrai.inference.groups import HeldFollowers
from astrai.inference.logprobs import TopLogprobs
from astrai.inference.metrics import EngineMetrics
from astrai.inference.params import SamplingParams, check_max_prompt_tokens
from astrai.inference.priority import scheduling_policy as policy_named
from astrai.inference.processors import describe
from astrai.inference.speculative import SpecCounters, next_budget
from astrai.inference.step_output import StepOutput
from astrai.inference.task import Rejection, Task, TaskState

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class StepPlan:
    """One ragged forward: row `i` feeds `token_ids[qo_i : qo_i + q_lens[i]]` of `tasks[i]`.

    `seq_lens[i]` is the KV length of request row `rows[i]` after the step; `samplers` are
    the tasks (in row order) that sample their next token from this forward, and
    `sample_rows` their row indices. `backend` is the attention backend to run it under.
    """

    tasks: list[Task] = field(default_factory=list)
    rows: list[int] = field(default_factory=list)
    q_lens: list[int] = field(default_factory=list)
    seq_lens: list[int] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    sample_rows: list[int] = field(default_factory=list)
    samplers: list[Task] = field(default_factory=list)
    backend: str | None = None
    draft_budgets: list[int] = field(default_factory=list)  # proposals each row may verify

    @property
    def decode_only(self) -> bool:
        """Every row feeds one token and samples: the shape a captured decode graph runs."""
        return len(self.samplers) == len(self.tasks) and max(self.q_lens) == 1


class InferenceScheduler(Admission):
    """Owns the waiting queue, the running set and the KV pool of one model (admission:
    `astrai.inference.admission.Admission`)."""

    def __init__(
        self,
        pool: PagePool,
        *,
        vocab_size: int,
        max_batch_size: int = 32,
        max_prefill_tokens: int = 2048,
        stop_ids: Sequence[int] = (),
        max_queue: int | None = None,
        max_prompt_tokens: int | None = None,
        adapters: AdapterSlots | NoAdapterSlots = NO_ADAPTER_SLOTS,
        speculative_tokens: int = 0,
        batch_invariant: bool = False,
        scheduling_policy: str = "fcfs",
    ) -> None:
        if max_prefill_tokens <= 0:
            raise ValueError(f"max_prefill_tokens must be positive, got {max_prefill_tokens}")
        check_max_prompt_tokens(max_prompt_tokens)
        self.pool = pool
        self.vocab_size = vocab_size
        self.max_batch_size = min(max_batch_size, pool.max_batch_size)
        self.max_prefill_tokens = max_prefill_tokens
        self.max_seq_len = pool.max_seq_len
        self.stop_ids = frozenset(stop_ids)
        self.max_queue = max_queue
        self.max_prompt_tokens = max_prompt_tokens
        self.policy_version = 0
        # LoRA adapter slots (`astrai.inference.adapters`): a request holds its adapter's
        # slot from admission to its end; `NoAdapterSlots`: the engine serves no adapters.
        self.adapter_slots = adapters
        # Speculative decoding: at most this many proposals per decoding request and step
        # (KV reserved for them: `StepPlan.draft_budgets`); 0: off.
        self.speculative_tokens = speculative_tokens
        self.spec = SpecCounters(enabled=speculative_tokens > 0)
        # Prefill chunks fixed by the prompt alone (`astrai.inference.batch_invariance`).
        self.batch_invariant = batch_invariant
        # Admission order and preemption victims (`astrai.inference.priority`).
        self.scheduling = policy_named(scheduling_policy)
        # Set by `fail_all` (the loop crashed): every new request is rejected with it.
        self.failure: str | None = None
        # Set whenever there is new work (a submission, a cancellation) for an idle loop.
        self.wakeup = threading.Event()

        self._waiting: deque[Task] = deque()
        self._running: list[Task] = []
        self._held = HeldFollowers()  # group followers waiting for their leader's prefill
        self._lock = threading.Lock()

        self.total_tasks = 0
        self.total_tokens = 0
        self.total_prompt_tokens = 0
        self.total_cached_tokens = 0
        self.num_steps = 0
        self.preemptions = 0
        # First tokens plus finished tasks: a step that changes it wakes streams at once.
        self.milestones = 0
        self.metrics = EngineMetrics()  # TTFT, inter-token latency, finish reasons

    # ------------------------------------------------------------------ queues
    @property
    def queue_full(self) -> bool:
        queued = len(self._waiting) + len(self._held)
        return self.max_queue is not None and queued >= self.max_queue

    def has_work(self) -> bool:
        return bool(self._waiting or self._running or len(self._held))

    def problem(self, prompt_ids: Sequence[int], params: SamplingParams) -> Rejection | None:
        """Why a request with valid `params` can never run (None: it can): the one prompt
        check of every caller (`astrai.inference.admission.prompt_problem`)."""
        return prompt_problem(
            prompt_ids,
            params,
            vocab_size=self.vocab_size,
            max_seq_len=self.max_seq_len,
            max_prompt_tokens=self.max_prompt_tokens,
            failure=self.failure,
        )

    def check_priority(self, priority: int) -> None:
        """A non-zero `priority` needs the "priority" policy: a ValueError naming it."""
        self.scheduling.check(priority)

    def submit(self, task: Task) -> Task:
        """Queue a checked task (`InferenceEngine.check_request`); rejected if the loop has
        crashed meanwhile, since nothing would ever run it."""
        return self.submit_group([task])[0]

    def submit_group(self, tasks: Sequence[Task]) -> list[Task]:
        """Queue the checked samples of one prompt (`tasks[0]` leads; same prompt and
        settings). When its prompt has pages to share, the followers are held until the
        leader's prefill completes; otherwise all are queued now. Rejected, all of them, if
        the loop has crashed meanwhile."""
        leader, followers = tasks[0], list(tasks[1:])
        now = time.perf_counter()
        for t in tasks:
            self.metrics.on_submit(t, now)
        ids, p = leader.prefill_ids, leader.params
        limit = p.prompt_logprobs_start - 1 if p.prompt_logprobs is not None else None
        gate = bool(followers) and self.pool.shareable_tokens(len(ids), limit) > 0
        with self._lock:
            self.total_tasks += len(tasks)
            failure = self.failure
            if failure is None:
                self._waiting.append(leader)
                if gate:
                    self._held.hold(leader, followers)
                else:
                    self._waiting.extend(followers)
        if failure is not None:
            for t in tasks:
                self._finish(t, "rejected", f"engine not ready: {failure}")
        else:
            self.wakeup.set()
        return list(tasks)

    def reject(self, task: Task, reason: str | Rejection) -> Task:
        """End a task that can never run at once (finish reason `rejected`, with `reason`;
        a `Rejection` is kept as `task.rejection`)."""
        with self._lock:
            self.total_tasks += 1
        task.rejection = reason if isinstance(reason, Rejection) else None
        self._finish(task, "rejected", str(reason))
        return task

    def uses_adapter(self, adapter: object) -> bool:
        """Whether a queued, held or running request runs with `adapter`."""
        with self._lock:
            tasks = (*self._waiting, *self._held, *self._running)
            return any(t.adapter is adapter and not t.finished for t in tasks)

    def cancel_task(self, task_id: int) -> bool:
        """Request cancellation; `cleanup` ends the task and frees its KV after the step."""
        with self._lock:
            for task in (*self._waiting, *self._held, *self._running):
                if task.id == task_id and not task.finished:
                    task.cancel_requested = True
                    self.wakeup.set()
                    return True
        return False

    def cancel_all(self) -> None:
        """Request cancellation of every waiting and running task."""
        with self._lock:
            for task in (*self._waiting, *self._held, *self._running):
                task.cancel_requested = True
        self.wakeup.set()

    def stats(self) -> dict[str, Any]:
        return {
            "total_tasks": self.total_tasks,
            "total_tokens": self.total_tokens,
            "total_prompt_tokens": self.total_prompt_tokens,
            "cached_prompt_tokens": self.total_cached_tokens,
            "active_tasks": len(self._running),
            "waiting_queue": len(self._waiting) + len(self._held),
            "held_followers": len(self._held),
            "steps": self.num_steps,
            "preemptions": self.preemptions,
            **self.spec.stats(),
            "policy_version": self.policy_version,
            **self.pool.stats(),
            **self.metrics.stats(),
        }

    # ------------------------------------------------------------------ weights
    def apply_weight_update(self, version: int | None, fn: Callable[[], Any]) -> int:
        """Run `fn` (which changes the weights) and advance the version (`None`: current + 1).

        An explicit `version` must be greater than the current one: new weights are a new
        policy. Prefix-cache pages built by older weights are dropped, so no request reuses
        them. The caller keeps the loop stopped.
        """
        if self.has_work():
            raise RuntimeError("apply_weight_update: tasks are still queued or running")
        new = self.policy_version + 1 if version is None else version
        _check_version(new, self.policy_version)
        fn()
        self.pool.invalidate_prefix_cache()
        self.policy_version = new
        return new

    # ------------------------------------------------------------------ one step
    def schedule(self) -> list[StepPlan]:
        """End cancelled tasks, admit waiting ones, and plan this step's forwards.

        One plan per attention backend of the running tasks; the prefill token budget is
        shared by all of them. Decoding tasks get their next token's KV first (preempting
        the newest tasks if the pool is short), then waiting tasks are admitted.
        """
        self.cleanup()
        self._reserve_decode()
        self._refill()
        groups: dict[Any, list[Task]] = {}
        for t in self._running:
            groups.setdefault(t.backend, []).append(t)
        budget = self.max_prefill_tokens
        plans = []
        for backend, group in groups.items():
            plan, budget = self._plan(group, budget)
            if plan.tasks:
                plan.backend = backend
                plans.append(plan)
        return plans

    def _plan(self, tasks: list[Task], budget: int) -> tuple[StepPlan, int]:
        plan = StepPlan()
        for t in [t for t in tasks if t.prefilled] + [t for t in tasks if not t.prefilled]:
            if t.finished or t.cancel_requested:
                continue
            if t.prefilled:  # decode: feed the newest token (its KV: `_reserve_decode`)
                new = [t.output_ids[-1]]
            else:
                left = t.prefill_len - t.computed
                n = min(left, budget)
                if n <= 0 or (self.batch_invariant and n < min(left, self.max_prefill_tokens)):
                    continue
                budget -= n
                new = t.prefill_ids[t.computed : t.computed + n]
            start, n = t.computed, len(new)
            if start + n >= t.prefill_len and t.params.max_tokens > 0:
                plan.sample_rows.append(len(plan.tasks))
                plan.samplers.append(t)
            plan.tasks.append(t)
            plan.draft_budgets.append(t.spec.budget if t.prefilled else 0)
            plan.rows.append(t.row)
            plan.q_lens.append(n)
            plan.seq_lens.append(start + n)
            plan.token_ids.extend(new)
            plan.positions.extend(range(start, start + n))
        return plan, budget

    def postprocess(self, plan: StepPlan, out: StepOutput) -> None:
        """Account the forward of `plan`, record its prompt log-probs, append the tokens each
        sampler emitted (`out.tokens[s]`, with their log-probs and top alternatives), each
        under the stop rules. Score-only tasks (`max_tokens=0`) end once their prompt is
        computed. A sampler in `out.faults` (its own sampling failed) or whose `on_token`
        callback raises ends `aborted` with the cause; the rest go on. A sampler in
        `out.stopped` (its structured output is complete) ends `stop` after its last token.
        A sampler that verified proposals (`out.proposed`) keeps the KV of those accepted."""
        accepted: dict[int, int] = {}  # plan row -> proposals kept (their KV is valid)
        if out.proposed is not None:
            for s, proposed in enumerate(out.proposed):
                if proposed:
                    kept = accepted[plan.sample_rows[s]] = out.accepted(s)
                    self.spec.record(plan.samplers[s], proposed, kept)
        for row, (t, n) in enumerate(zip(plan.tasks, plan.q_lens)):
            was_prefilled = t.prefilled
            t.computed += n + accepted.get(row, 0) if accepted else n
            if t.prefilled and not was_prefilled:
                self._prefilled(t)
        for scores in out.prompt_logprobs or ():
            t = plan.tasks[scores.row]
            t.prompt_logprobs[scores.first : scores.first + len(scores.tokens)] = scores.tokens
        for t in plan.tasks:
            if t.params.max_tokens == 0 and t.prefilled:
                self._finish(t, "length")
        self.num_steps += 1
        now = time.perf_counter()
        faults, stopped, tops = out.faults, out.stopped, out.top_logprobs
        for s, (t, tokens, logprobs) in enumerate(zip(plan.samplers, out.tokens, out.logprobs)):
            if s in faults:
                logger.warning("request %d aborted: %s", t.id, faults[s])
                self._finish(t, "aborted", faults[s])
                continue
            last = len(tokens) - 1
            for k, tok in enumerate(tokens):
                if t.finished:
                    break
                top = tops[s][k] if tops is not None else ()
                self._emit(t, tok, logprobs[k], top, now, k == last and s in stopped)

    def _emit(self, t: Task, tok: int, lp: float, top: TopLogprobs, now: float, done: bool) -> None:
        """Append one sampled token to `t` and apply the stop rules (`done`: its structured
        output is complete)."""
        t.output_ids.append(tok)
        t.logprobs.append(lp)
        if t.params.logprobs > 0:
            t.top_logprobs.append(top)
        self.total_tokens += 1
        if t.first_token_at is None:
            t.first_token_at = now
            self.milestones += 1
        self.metrics.on_token(t, now)
        if t.on_token is not None:
            try:
                t.on_token(t, tok, lp)
            except Exception as err:
                logger.exception("on_token callback of task %d failed", t.id)
                self._finish(t, "aborted", f"on_token callback failed: {describe(err)}")
                return
        p = t.params
        stops = self.stop_ids if p.stop_ids is None else p.stop_ids
        if done or (not p.ignore_eos and tok in stops):
            self._finish(t, "stop")
        elif len(t.output_ids) >= p.max_tokens or t.total_len >= self.max_seq_len:
            self._finish(t, "length")

    def _prefilled(self, task: Task) -> None:
        """`task`'s prefill is complete: its complete pages enter the prefix cache (it keeps
        its references), and its group's followers are queued first, to find them there."""
        if self.pool.shares_prefixes:
            self.pool.cache_task(task.row, task.materialized_ids(), task.prefix_namespace)
        self._release(task)

    def _release(self, leader: Task) -> None:
        """Queue `leader`'s held followers at the front, in their order."""
        with self._lock:
            followers = self._held.release(leader)
            self._waiting.extendleft(reversed(followers))
        if followers:
            self.wakeup.set()

    def abort(self, plan: StepPlan, reason: str) -> None:
        """The plan could not run (e.g. its strict attention backend cannot serve it)."""
        for t in plan.tasks:
            self._finish(t, "aborted", reason)

    # ------------------------------------------------------------------ release
    def cleanup(self) -> None:
        """End cancelled tasks and release KV of finished ones (caching complete pages)."""
        with self._lock:
            waiting_cancelled = [t for t in self._waiting if t.cancel_requested]
            for t in waiting_cancelled:
                self._waiting.remove(t)
            waiting_cancelled += self._held.take_cancelled()
            done = [t for t in self._running if t.finished or t.cancel_requested]
            if done:
                self._running = [t for t in self._running if t not in done]
        for t in waiting_cancelled:
            self._finish(t, "cancelled")
        for t in done:
            self._free_kv(t)
            if not t.finished:
                self._finish(t, "cancelled")

    def fail_all(self, reason: str) -> None:
        """The loop crashed: end every task (`aborted`), free its KV, reject new ones."""
        self.failure = reason
        with self._lock:
            tasks = [*self._waiting, *self._held.drain(), *self._running]
            self._waiting.clear()
            self._running.clear()
        for task in tasks:
            try:
                self._free_kv(task, cache=False)
            except Exception:
                logger.exception("freeing KV of task %d failed", task.id)
                task.row = None
            self._finish(task, "aborted", f"engine error: {reason}")

    def _free_kv(self, task: Task, *, cache: bool = True) -> None:
        """Release `task`'s row (its computed complete pages enter the prefix cache, with
        `cache`) and its adapter slot."""
        if task.adapter_slot >= 0:
            self.adapter_slots.release(task.adapter_slot)
            task.adapter_slot = -1
        if task.row is not None:
            if cache and task.computed > 0:
                self.pool.cache_task(task.row, task.materialized_ids(), task.prefix_namespace)
            self.pool.free_task(task.row)
            task.row = None

    def _reserve_decode(self) -> None:
        """Back the next token of every decoding task with KV, oldest first; when the pool is
        short, preempt the newest running task (possibly the one asking; under "priority"
        the least urgent) and retry. A task that is alone and still cannot grow is aborted:
        nothing else holds memory."""
        i = 0
        while i < len(self._running):
            t = self._running[i]
            i += 1
            if t.finished or t.cancel_requested or not t.prefilled:
                continue
            k = self.speculative_tokens and next_budget(
                t, self.speculative_tokens, self.max_seq_len
            )
            t.spec.budget = k if k and self.pool.ensure(t.row, t.total_len + k) else 0
            self.pool.release_unread(t.row, t.total_len)  # behind a sliding window
            while not self.pool.ensure(t.row, t.total_len):
                if len(self._running) == 1:
                    self._finish(
                        t,
                        "aborted",
                        f"KV allocation failed while decoding: {t.total_len} tokens of this "
                        f"request alone do not fit in the KV pool "
                        f"({self.pool.capacity_tokens} tokens)",
                    )
                    break
                victim = self.scheduling.victim(self._running)
                before = self._running.index(victim) < i - 1  # already backed: keep our place
                self._preempt(victim)
                if victim is t:
                    break
                i -= before

    def _preempt(self, task: Task) -> None:
        """Free `task`'s KV (caching its complete pages) and requeue it at the front (with
        its group's followers behind it, if it was still prefilling)."""
        with self._lock:
            self._running.remove(task)
            self._waiting.extendleft(reversed(self._held.release(task)))
            self._waiting.appendleft(task)
        self._free_kv(task)
        task.recompute = len(task.output_ids)
        task.computed = 0
        task.state = TaskState.WAITING
        task.preemptions += 1
        self.preemptions += 1
        logger.debug("preempted task %d after %d tokens", task.id, task.recompute)

    def _finish(self, task: Task, reason: str, error: str | None = None) -> None:
        if task.finished:
            return
        task.state = TaskState.FINISHED
        task.finish_reason = reason
        task.error = error
        self.milestones += 1
        if self._held.holds_for(task):  # a leader that ends before its prefill completed
            self._release(task)
        self.metrics.on_finish(task)
        if task.on_finish is not None:
            try:
                task.on_finish(task)
            except Exception:
                logger.exception("on_finish callback of task %d failed", task.id)


def _check_version(version: object, current: int) -> None:
    """A new policy version is an int (not a bool) greater than the current one."""
    if isinstance(version, bool) or not isinstance(version, int) or version < 0:
        raise ValueError(f"policy version must be a non-negative int, got {version!r}")
    if version < current:
        raise ValueError(f"policy version {version} is older than the current {current}")
    if version == current:
        raise ValueError(
            f"policy version {version} must be greater than the current {current}: "
            "new weights are a new policy"
        )
