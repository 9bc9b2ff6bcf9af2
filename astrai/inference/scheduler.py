"""Continuous batching: a loop of cleanup, refill, and one shared `_step()`.

The background thread and the synchronous `run_batch()` (RL rollouts) both drive the
same `_cleanup` / `_refill` / `_step`, so the two paths cannot drift apart. A step packs
every active request into one ragged forward: decode rows (one token each) always run,
prefill rows take chunks from a per-step token budget, so a long prompt never stalls
decoding.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from astrai.extension import BackendUnavailable, attn_backend, selected_backend
from astrai.inference.cache import PagePool
from astrai.inference.graph import DecodeGraphRunner
from astrai.inference.sampling import SamplingParams, sample_batch
from astrai.inference.task import Task, TaskState
from astrai.inference.workspace import InferenceWorkspace
from astrai.model import Transformer

logger = logging.getLogger(__name__)


@dataclass
class BatchResult:
    """One `run_batch` output: token ids, aligned log-probs, and why it ended."""

    token_ids: list[int]
    logprobs: list[float] | None
    finish_reason: str
    error: str | None = None


class InferenceScheduler:
    """Owns the waiting queue, the running set and the KV pool of one model."""

    def __init__(
        self,
        model: Transformer,
        pool: PagePool,
        *,
        max_batch_size: int = 32,
        max_prefill_tokens: int = 2048,
        stop_ids: Sequence[int] = (),
        max_queue: int | None = None,
    ) -> None:
        if max_prefill_tokens <= 0:
            raise ValueError(f"max_prefill_tokens must be positive, got {max_prefill_tokens}")
        self.model = model
        self.pool = pool
        self.device = next(model.parameters()).device
        self.max_batch_size = min(max_batch_size, pool.req_pool.num_reqs)
        self.max_prefill_tokens = max_prefill_tokens
        self.max_seq_len = pool.max_seq_len
        self.stop_ids = frozenset(stop_ids)
        self.max_queue = max_queue
        self.policy_version = 0

        self._waiting: deque[Task] = deque()
        self._running: list[Task] = []
        self._lock = threading.Lock()
        self._wakeup = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._crashed: str | None = None
        self._generators: dict[int, torch.Generator] = {}
        # Set by the engine when decode steps replay captured graphs (see graph.py).
        self.graph_runner: DecodeGraphRunner | None = None
        self.workspace: InferenceWorkspace | None = None
        self._last_sampled: torch.Tensor | None = None

        self.total_tasks = 0
        self.total_tokens = 0
        self.total_prompt_tokens = 0
        self.total_cached_tokens = 0
        self.num_steps = 0

    # ------------------------------------------------------------------ public API
    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    @property
    def ready(self) -> bool:
        return self.running and self._crashed is None

    @property
    def queue_full(self) -> bool:
        return self.max_queue is not None and len(self._waiting) >= self.max_queue

    def start(self) -> None:
        if self.running:
            return
        self._stop.clear()
        self._crashed = None
        self._thread = threading.Thread(target=self._loop, name="astrai-scheduler", daemon=True)
        self._thread.start()

    def stop(self, timeout: float | None = 30.0) -> None:
        """Stop the loop after its current step; queued and running tasks stay as they are."""
        self._stop.set()
        self._wakeup.set()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None

    def submit(self, task: Task) -> Task:
        """Queue a task; one that can never run is finished at once as `rejected`."""
        if task.backend is None:
            task.backend = selected_backend()
        reason = self._rejection(task)
        with self._lock:
            self.total_tasks += 1
        if reason is not None:
            self._finish(task, "rejected", reason)
            return task
        with self._lock:
            self._waiting.append(task)
        self._wakeup.set()
        return task

    def cancel_task(self, task_id: int) -> bool:
        """Request cancellation; the loop ends the task and frees its KV at the next cleanup."""
        with self._lock:
            for task in (*self._waiting, *self._running):
                if task.id == task_id and not task.finished:
                    task.cancel_requested = True
                    self._wakeup.set()
                    return True
        return False

    def has_work(self) -> bool:
        return bool(self._waiting or self._running)

    def stats(self) -> dict[str, Any]:
        return {
            "total_tasks": self.total_tasks,
            "total_tokens": self.total_tokens,
            "total_prompt_tokens": self.total_prompt_tokens,
            "cached_prompt_tokens": self.total_cached_tokens,
            "active_tasks": len(self._running),
            "waiting_queue": len(self._waiting),
            "steps": self.num_steps,
            "policy_version": self.policy_version,
            "ready": self.ready,
            **self.pool.stats(),
        }

    # ------------------------------------------------------------------ weights
    def _check_idle(self, what: str) -> None:
        if self.running:
            raise RuntimeError(f"{what}: stop the scheduler loop first")
        if self.has_work():
            raise RuntimeError(f"{what}: tasks are still queued or running")

    def update_weights(self, version: int) -> None:
        """Declare that the model now holds weights of policy `version` (never decreasing).

        Prefix-cache pages built by older weights are dropped, so no request reuses them.
        """
        self._check_idle("update_weights")
        if not isinstance(version, int) or version < 0:
            raise ValueError(f"policy version must be a non-negative int, got {version!r}")
        if version < self.policy_version:
            raise ValueError(f"policy version {version} is older than {self.policy_version}")
        if version > self.policy_version:
            self.pool.invalidate_prefix_cache()
        self.policy_version = version

    def apply_weight_update(self, version: int | None, fn: Callable[[], Any]) -> int:
        """Run `fn` (which changes the weights) and bump the version (`None`: current + 1)."""
        self._check_idle("apply_weight_update")
        new = self.policy_version + 1 if version is None else version
        if not isinstance(new, int) or new < self.policy_version:
            raise ValueError(f"policy version {new!r} is older than {self.policy_version}")
        fn()
        self.pool.invalidate_prefix_cache()
        self.policy_version = new
        return new

    # ------------------------------------------------------------------ synchronous rollouts
    def run_batch(
        self,
        prompt_ids_list: Sequence[Sequence[int]],
        *,
        max_tokens: int = 256,
        temperature: float = 1.0,
        top_p: float = 1.0,
        top_k: int = 0,
        frequency_penalty: float = 0.0,
        seed: int | None = None,
        ignore_eos: bool = False,
        return_logprobs: bool = False,
        return_details: bool = False,
    ) -> list[Any]:
        """Generate for every prompt on the calling thread; results in input order.

        Returns token-id lists, or `(ids, logprobs)` pairs with `return_logprobs`, or
        `BatchResult`s with `return_details`. A rejected prompt (empty, too long,
        `max_tokens <= 0`, KV allocation failed) gets finish reason `rejected` and an
        error; it never blocks the others.
        """
        if self.running:
            raise RuntimeError("run_batch: the background loop is running; stop it first")
        params = SamplingParams(
            temperature=temperature, top_p=top_p, top_k=top_k, frequency_penalty=frequency_penalty
        )
        params.validate()
        tasks = []
        for i, ids in enumerate(prompt_ids_list):
            p = params if seed is None else SamplingParams(**{**vars(params), "seed": seed + i})
            tasks.append(
                self.submit(
                    Task(
                        prompt_ids=list(ids),
                        params=p,
                        max_tokens=max_tokens,
                        stop_ids=self.stop_ids,
                        ignore_eos=ignore_eos,
                    )
                )
            )
        while self.has_work():
            self._iteration()
        results = []
        for t in tasks:
            lp = list(t.logprobs) if (return_logprobs or return_details) else None
            if return_details:
                results.append(BatchResult(list(t.output_ids), lp, t.finish_reason, t.error))
            elif return_logprobs:
                results.append((list(t.output_ids), lp))
            else:
                results.append(list(t.output_ids))
        return results

    # ------------------------------------------------------------------ the loop
    def _loop(self) -> None:
        logger.debug("scheduler loop started")
        while not self._stop.is_set():
            if not self.has_work():
                self._wakeup.wait(timeout=0.1)
                self._wakeup.clear()
                continue
            try:
                self._iteration()
            except Exception as err:
                logger.exception("scheduler loop crashed")
                self._crashed = f"{type(err).__name__}: {err}"
                self._fail_all(self._crashed)
                return

    def _iteration(self) -> None:
        self._cleanup()
        self._refill()
        if self._running:
            self._step(self._running)
        self._cleanup()

    def _fail_all(self, reason: str) -> None:
        with self._lock:
            tasks = [*self._waiting, *self._running]
            self._waiting.clear()
            self._running.clear()
        for task in tasks:
            if task.row is not None:
                try:
                    self.pool.free_task(task.row)
                except Exception:
                    logger.exception("freeing KV of task %d failed", task.id)
                task.row = None
            self._finish(task, "aborted", f"engine error: {reason}")

    def _cleanup(self) -> None:
        """End cancelled tasks and release KV of finished ones (caching complete pages)."""
        with self._lock:
            waiting_cancelled = [t for t in self._waiting if t.cancel_requested]
            for t in waiting_cancelled:
                self._waiting.remove(t)
            done = [t for t in self._running if t.finished or t.cancel_requested]
            self._running = [t for t in self._running if t not in done]
        for t in waiting_cancelled:
            self._finish(t, "cancelled")
        for t in done:
            if t.row is not None:
                if t.computed > 0:
                    self.pool.cache_task(t.row, t.materialized_ids())
                self.pool.free_task(t.row)
                t.row = None
            self._generators.pop(t.id, None)
            if not t.finished:
                self._finish(t, "cancelled")

    def _refill(self) -> None:
        """Admit waiting tasks while there are request rows and KV for their prompts."""
        admitted: list[Task] = []
        try:
            self._admit(admitted)
        finally:
            self._order_rows(admitted)

    def _order_rows(self, tasks: list[Task]) -> None:
        """Contiguous rows: hand the rows taken in one refill out by prompt length.

        Rows are fixed there and nothing is written before the first forward, so the rows
        can be swapped. Neighbouring rows then hold requests of similar length (all grow by
        one per step), and the CPU decode attention, which reads ranges of rows padded to
        their longest, pads much less.
        """
        if len(tasks) < 2 or self.pool.mode != "contiguous":
            return
        rows = sorted(t.row for t in tasks)
        for task, row in zip(sorted(tasks, key=lambda t: len(t.prompt_ids)), rows):
            task.row = row

    def _admit(self, admitted: list[Task]) -> None:
        while self._waiting and len(self._running) < self.max_batch_size:
            task = self._waiting[0]
            need = len(task.prompt_ids) + 1
            if not self.pool.can_hold(need, reserve_pages=len(self._running)):
                if not self._running:  # nothing will ever free memory for it
                    with self._lock:
                        self._waiting.popleft()
                    self._finish(task, "rejected", "KV allocation failed: prompt does not fit")
                    continue
                return
            alloc = self.pool.alloc_task(task.prompt_ids)
            if alloc is None:
                return
            row, cached = alloc
            if not self.pool.ensure(row, len(task.prompt_ids)):
                self.pool.free_task(row)
                if not self._running:
                    with self._lock:
                        self._waiting.popleft()
                    self._finish(task, "rejected", "KV allocation failed")
                    continue
                return
            with self._lock:
                self._waiting.popleft()
                self._running.append(task)
            task.row, task.cached_len = row, cached
            admitted.append(task)
            task.computed = min(cached, len(task.prompt_ids) - 1)
            task.state = TaskState.RUNNING
            task.policy_version = self.policy_version
            self.total_prompt_tokens += len(task.prompt_ids)
            self.total_cached_tokens += task.computed
            if task.params.seed is not None:
                gen = torch.Generator(device=self.device)
                gen.manual_seed(task.params.seed)
                self._generators[task.id] = gen

    def _step(self, tasks: list[Task]) -> None:
        """Advance every task by one forward: decode rows one token, prefill rows a chunk.

        Tasks are grouped by the attention backend selected when they were submitted
        (`attn_backend(...)` is per thread, and this may run on the loop thread); the
        prefill token budget is shared by all groups of the step.
        """
        groups: dict[Any, list[Task]] = {}
        for t in tasks:
            groups.setdefault(t.backend, []).append(t)
        budget = self.max_prefill_tokens
        for backend, group in groups.items():
            try:
                with attn_backend(backend):
                    budget = self._step_group(group, budget)
            except BackendUnavailable as err:  # a strict choice that cannot serve: fail those only
                for t in group:
                    self._finish(t, "aborted", str(err))

    @torch.inference_mode()
    def _step_group(self, tasks: list[Task], budget: int) -> int:
        """One ragged forward over `tasks`, sampling, bookkeeping; returns the budget left."""
        rows, seq_lens, q_lens, token_ids, positions = [], [], [], [], []
        sampling: list[Task] = []
        batch: list[tuple[Task, int]] = []
        for t in [t for t in tasks if t.prefilled] + [t for t in tasks if not t.prefilled]:
            if t.finished or t.cancel_requested:
                continue
            if t.prefilled:  # decode: feed the newest token
                if not self.pool.ensure(t.row, t.total_len):
                    self._finish(t, "aborted", "KV allocation failed while decoding")
                    continue
                new = [t.output_ids[-1]]
            else:
                n = min(len(t.prompt_ids) - t.computed, budget)
                if n <= 0:
                    continue
                budget -= n
                new = t.prompt_ids[t.computed : t.computed + n]
            start = t.computed
            rows.append(t.row)
            q_lens.append(len(new))
            seq_lens.append(start + len(new))
            token_ids.extend(new)
            positions.extend(range(start, start + len(new)))
            batch.append((t, len(new)))
            if start + len(new) >= len(t.prompt_ids):
                sampling.append(t)
        if not batch:
            return budget
        runner = self.graph_runner
        padded = None
        if runner is not None and max(q_lens) == 1 and len(sampling) == len(batch):
            padded = runner.padded_size(len(batch))
        if padded is not None:  # pure decode: replay a captured graph on the workspace
            ws = self.workspace
            same = self._last_sampled is not None and ws.last_rows == tuple(rows)
            ws.prepare(
                rows,
                seq_lens,
                None if same else token_ids,
                padded,
                device_tokens=self._last_sampled if same else None,
            )
            logits = runner.run(padded, len(batch))
        else:
            if self.workspace is not None:
                self.workspace.last_rows = None
            kv_cache = self.pool.bind_tasks(rows, seq_lens, q_lens)
            ends = torch.tensor(q_lens).cumsum(0) - 1
            sample_rows = [i for i, (t, _) in enumerate(batch) if t in sampling]
            ids = torch.tensor(token_ids, dtype=torch.int64, device=self.device)
            pos = torch.tensor(positions, dtype=torch.int64, device=self.device)
            logits_idx = ends[sample_rows].to(self.device)
            logits = self.model.forward_packed(
                ids, pos, kv_cache, logits_idx, max_position=max(positions)
            )
        self._last_sampled = None
        for t, n in batch:
            t.computed += n
        self.num_steps += 1
        if not sampling:
            return budget
        new_tokens, logprobs = sample_batch(
            logits.float(),
            [t.params for t in sampling],
            generated=[t.output_ids for t in sampling],
            generators=[self._generators.get(t.id) for t in sampling],
        )
        if padded is not None:
            self._last_sampled = new_tokens
        now = time.perf_counter()
        for t, tok, lp in zip(sampling, new_tokens.tolist(), logprobs.tolist()):
            t.output_ids.append(tok)
            t.logprobs.append(lp)
            self.total_tokens += 1
            if t.first_token_at is None:
                t.first_token_at = now
            if t.on_token is not None:
                t.on_token(t, tok, lp)
            if tok in t.stop_ids and not t.ignore_eos:
                self._finish(t, "stop")
            elif len(t.output_ids) >= t.max_tokens or t.total_len >= self.max_seq_len:
                self._finish(t, "length")
        return budget

    # ------------------------------------------------------------------ helpers
    def _rejection(self, task: Task) -> str | None:
        if not task.prompt_ids:
            return "empty prompt"
        if len(task.prompt_ids) >= self.max_seq_len:
            return (
                f"prompt too long: {len(task.prompt_ids)} tokens, the context holds "
                f"{self.max_seq_len} (prompt + at least one generated token)"
            )
        if task.max_tokens <= 0:
            return f"max_tokens must be positive, got {task.max_tokens}"
        vocab = self.model.config.vocab_size
        bad = [i for i in task.prompt_ids if not 0 <= i < vocab]
        if bad:
            return f"token id(s) outside the vocabulary [0, {vocab}): {bad[:5]}"
        try:
            task.params.validate()
        except ValueError as err:
            return str(err)
        if self._crashed is not None:
            return f"engine not ready: {self._crashed}"
        return None

    def _finish(self, task: Task, reason: str, error: str | None = None) -> None:
        if task.finished:
            return
        task.state = TaskState.FINISHED
        task.finish_reason = reason
        task.error = error
        task.finished_at = time.perf_counter()
        if task.on_finish is not None:
            try:
                task.on_finish(task)
            except Exception:
                logger.exception("on_finish callback of task %d failed", task.id)
