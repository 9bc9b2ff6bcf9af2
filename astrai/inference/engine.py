"""`InferenceEngine`: text in, text out, over a scheduler that plans and a runner that runs.

Three callers share it: the HTTP server (`generate_async` / `submit`), evaluation
(`run_batch`, and `score` for log-likelihoods), and GRPO rollouts (`run_batch`, token ids
and log-probs).
Its step is nano-vllm's: `scheduler.schedule()` -> `runner.run(plan)` ->
`scheduler.postprocess(...)`, driven by one background thread or, for `run_batch`, by the
calling thread; both use `step()`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import threading
from collections.abc import AsyncGenerator, Callable, Generator, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch
from tqdm.auto import tqdm

from astrai.extension import BackendUnavailable, selected_backend
from astrai.inference.cache import PagePool
from astrai.inference.grammar import grammar_compiler
from astrai.inference.graph import DecodeGraphRunner
from astrai.inference.handoff import Handoff
from astrai.inference.logprobs import MAX_LOGPROBS, ScoreResult
from astrai.inference.result import GenerateResult
from astrai.inference.runner import ModelRunner
from astrai.inference.sampling import SamplingParams
from astrai.inference.scheduler import InferenceScheduler
from astrai.inference.scoring import check_score_requests, score_phases, score_result
from astrai.inference.structured import StructuredOutput, per_prompt
from astrai.inference.task import Rejection, Task
from astrai.model import Transformer
from astrai.model.mla_config import kv_geometry
from astrai.tokenizer import AutoTokenizer

logger = logging.getLogger(__name__)

__all__ = [
    "BatchResult",
    "EngineNotReady",
    "GenerateResult",
    "InferenceEngine",
    "RequestRejected",
]


class EngineNotReady(RuntimeError):
    """The engine was shut down, or its loop crashed."""


class RequestRejected(ValueError):
    """Valid settings, but a prompt that can never run (empty, too long, ids outside the
    vocabulary, `max_tokens` <= 0, prompt + `max_tokens` beyond the context with
    `max_tokens_policy="error"`, the engine crashed): `submit` ends such a request at once
    with finish reason `rejected` instead of raising. `param`: the setting at fault
    (``"max_tokens"``), None for the prompt."""

    def __init__(self, reason: str, param: str | None = None) -> None:
        super().__init__(reason)
        self.param = param


@dataclass
class BatchResult:
    """One `run_batch` output: token ids, aligned log-probs, and why it ended."""

    token_ids: list[int]
    logprobs: list[float] | None
    finish_reason: str
    error: str | None = None


class InferenceEngine:
    """A model, its tokenizer, a KV pool, a scheduler, a model runner and a loop thread.

    `cache_mode="contiguous"` (default) gives every batch slot `max_seq_len` fixed KV
    slots; `"paged"` shares a pool of `page_size`-token pages (budget `kv_tokens` or
    `memory_fraction` of free memory) with radix prefix sharing when `page_size > 1`
    (`prefix_cache=False` turns it off, `True` forces it on). `logprob_chunk` bounds the
    prompt positions whose full-vocabulary logits exist at once (prompt log-probs, `score`).
    `stream_interval` (seconds): streamed text may wait that long to be delivered with the
    next steps' (first tokens and ends never wait), so the readers' per-wake-up work does
    not compete with steps far shorter than it (`astrai.inference.handoff`); 0: every step.
    """

    def __init__(
        self,
        model: Transformer,
        tokenizer: AutoTokenizer,
        *,
        max_batch_size: int = 32,
        max_seq_len: int | None = None,
        cache_mode: Literal["contiguous", "paged"] = "contiguous",
        page_size: int = 16,
        kv_tokens: int | None = None,
        memory_fraction: float | None = None,
        prefix_cache: bool | None = None,
        max_prefill_tokens: int = 2048,
        max_queue: int | None = None,
        decode_graphs: bool | str | None = None,
        logprob_chunk: int = 512,
        stream_interval: float = 0.005,
        start: bool = True,
    ) -> None:
        # No .eval() here: GRPO shares the live policy module, whose mode Lightning owns. The
        # model has no dropout; the runner runs it under inference_mode.
        self.model = model
        self.tokenizer = tokenizer
        param = next(model.parameters())
        cfg = model.config
        if len(tokenizer) > cfg.vocab_size:
            raise ValueError(
                f"tokenizer has {len(tokenizer)} tokens but the model's vocab_size is {cfg.vocab_size}"
            )
        self.pool = PagePool(
            num_layers=cfg.num_hidden_layers,
            **kv_geometry(cfg),  # K/V per kv head, or MLA's latent (astrai/model/mla_config.py)
            dtype=param.dtype,
            device=param.device,
            max_batch_size=max_batch_size,
            max_seq_len=max_seq_len or min(cfg.max_position_embeddings, 4096),
            mode=cache_mode,
            page_size=page_size,
            kv_tokens=kv_tokens,
            memory_fraction=memory_fraction,
            enable_radix=prefix_cache,
        )
        self.handoff = Handoff(stream_interval)
        self.scheduler = InferenceScheduler(
            self.pool,
            vocab_size=cfg.vocab_size,
            max_batch_size=max_batch_size,
            max_prefill_tokens=max_prefill_tokens,
            stop_ids=tokenizer.stop_ids,
            max_queue=max_queue,
        )
        self.runner = ModelRunner(
            model,
            self.pool,
            max_batch_size=max_batch_size,
            decode_graphs=decode_graphs,
            logprob_chunk=logprob_chunk,
            grammar=grammar_compiler(tokenizer),
        )
        self._closed = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if start:
            self.start()

    # ------------------------------------------------------------------ public facts
    @property
    def policy_version(self) -> int:
        """Version of the weights the engine generates with (see `update_weights`)."""
        return self.scheduler.policy_version

    @property
    def max_seq_len(self) -> int:
        """Context length of one request: prompt plus generated tokens."""
        return self.pool.max_seq_len

    @property
    def vocab_size(self) -> int:
        return self.scheduler.vocab_size

    @property
    def queue_full(self) -> bool:
        return self.scheduler.queue_full

    @property
    def graph_runner(self) -> DecodeGraphRunner | None:
        """The decode graph runner (None: eager decode)."""
        return self.runner.graph_runner

    @property
    def cuda_graph_enabled(self) -> bool:
        return self.runner.cuda_graph_enabled

    @property
    def device(self) -> torch.device:
        return self.pool.device

    # ------------------------------------------------------------------ the loop
    @property
    def running(self) -> bool:
        """The background loop thread is alive."""
        return self._thread is not None and self._thread.is_alive()

    @property
    def ready(self) -> bool:
        return not self._closed and self.running and self.scheduler.failure is None

    def start(self) -> None:
        """Start the background loop (a restart after a crash accepts requests again)."""
        if self.running:
            return
        self._stop.clear()
        self.scheduler.failure = None
        self._thread = threading.Thread(target=self._loop, name="astrai-engine", daemon=True)
        self._thread.start()

    def stop(self, timeout: float | None = 30.0) -> None:
        """Stop the loop after its current step; queued and running tasks stay as they are."""
        self._stop.set()
        self.scheduler.wakeup.set()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None
        self.handoff.flush()

    def step(self) -> None:
        """One step: plan, run each plan, post-process, then free what finished.

        Faults are contained: a request whose own sampling fails (a logits processor, its
        seed) ends `aborted` alone (the runner reports it); a plan whose (strict) attention
        backend cannot serve it, or whose model forward raises, aborts that plan's tasks
        only, and the loop goes on.
        """
        scheduler, runner = self.scheduler, self.runner
        self.handoff.begin_step()  # streamed text leaves once per step (astrai.inference.handoff)
        milestones = scheduler.milestones
        try:
            for plan in scheduler.schedule():
                try:
                    out = runner.run(plan)
                except BackendUnavailable as err:
                    scheduler.abort(plan, str(err))
                    continue
                except Exception as err:
                    n = len(plan.tasks)
                    logger.exception("model forward failed; aborting its %d requests", n)
                    scheduler.abort(plan, f"model forward failed: {type(err).__name__}: {err}")
                    continue
                scheduler.postprocess(plan, *out)
            scheduler.cleanup()
        finally:  # first tokens and ends go at once; other text within `stream_interval`
            self.handoff.end_step(urgent=scheduler.milestones != milestones)

    def _loop(self) -> None:
        logger.debug("engine loop started")
        wakeup = self.scheduler.wakeup
        while not self._stop.is_set():
            if not self.scheduler.has_work():
                self.handoff.flush()  # nothing follows to deliver what is held
                wakeup.wait(timeout=0.1)
                wakeup.clear()
                continue
            try:
                self.step()
            except Exception as err:
                logger.exception("engine loop crashed")
                self.scheduler.fail_all(f"{type(err).__name__}: {err}")
                return

    def _pause(self) -> None:
        """Let the loop finish the work it has, then stop it."""
        while self.scheduler.has_work():
            threading.Event().wait(0.01)
            if not self.running:
                break
        self.stop()

    # ------------------------------------------------------------------ lifecycle
    def shutdown(self) -> None:
        """Stop the loop and end every open stream (finish reason `cancelled`)."""
        if self._closed:
            return
        self._closed = True
        self.scheduler.cancel_all()
        deadline = 50
        while self.running and self.scheduler.has_work() and deadline:
            threading.Event().wait(0.02)
            deadline -= 1
        self.stop()
        if self.scheduler.has_work():  # loop was not running: clean up on this thread
            self.scheduler.cleanup()

    def __enter__(self) -> InferenceEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    def get_stats(self) -> dict[str, Any]:
        """Counters since start (total_tasks, total_prompt_tokens, cached_prompt_tokens,
        total_tokens generated, steps, preemptions, finished_requests by reason), current
        load (active_tasks running, waiting_queue, kv_usage), the prefix cache's hit rate,
        and the engine-measured latencies: `ttft_seconds` / `itl_seconds` histograms (queued
        -> first token, gaps between tokens) with recent p50 / p99. The server's `/metrics`
        exposes these same numbers (astrai/serve/metrics.py)."""
        return {**self.scheduler.stats(), "ready": self.ready}

    # ------------------------------------------------------------------ submission
    def encode(self, prompt: str | Sequence[int]) -> list[int]:
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt)
        return list(prompt)

    def check_request(self, prompt_ids: Sequence[int], params: SamplingParams) -> None:
        """The one request check, run once per request by `submit` and `run_batch`.

        Bad settings raise `ValueError` naming the parameter (`top_p must be ...`); a prompt
        that can never run raises `RequestRejected` (a `ValueError`) saying why.
        """
        params.validate(vocab_size=self.vocab_size)
        if params.structured is not None:  # compiled (and cached) now: a bad one is a 400
            grammar_compiler(self.tokenizer).compile(params.structured)
        problem = self.scheduler.problem(prompt_ids, params)
        if problem is not None:
            raise RequestRejected(problem.reason, problem.param)

    def _queue(self, task: Task, rejection: str | Rejection | None) -> Task:
        if rejection is None:
            return self.scheduler.submit(task)
        return self.scheduler.reject(task, rejection)

    def submit(
        self,
        prompt: str | Sequence[int],
        params: SamplingParams | None = None,
        **sampling: Any,
    ) -> GenerateResult:
        """Queue one request and return its `GenerateResult` at once.

        Settings come as `params` and/or `SamplingParams` keywords (max_tokens,
        max_tokens_policy, ignore_eos, stop_ids, temperature, top_p, top_k, min_p,
        presence_penalty, frequency_penalty, logit_bias, seed, logprobs_mode, logprobs,
        prompt_logprobs, prompt_logprobs_start, logits_processors), keywords overriding
        `params`. A seed may be any int (it is used mod 2**64).
        Invalid settings raise `ValueError` naming the parameter before anything is queued;
        a prompt that can never run ends at once with finish reason `rejected` (see
        `check_request`).
        """
        if self._closed:
            raise EngineNotReady("the engine has been shut down")
        params = _params(params, sampling)
        prompt_ids = self.encode(prompt)
        rejection = None
        try:
            self.check_request(prompt_ids, params)  # bad settings raise: nothing is queued
        except RequestRejected as err:
            rejection = Rejection(str(err), err.param)
        task = Task(prompt_ids=prompt_ids, params=params, backend=selected_backend())
        result = GenerateResult(task, self.tokenizer)
        task.on_token = result.on_token
        task.on_finish = result.on_finish
        self._queue(task, rejection)
        return result

    def cancel(self, result: GenerateResult | int) -> bool:
        return self.scheduler.cancel_task(result if isinstance(result, int) else result.id)

    # ------------------------------------------------------------------ generate
    def generate(
        self,
        prompt: str | Sequence[str],
        *,
        stream: bool = False,
        **kwargs: Any,
    ) -> str | list[str] | Generator[str, None, None] | Generator[tuple[int, str], None, None]:
        """str -> str; list -> list[str]; `stream=True`: text deltas, or `(index, delta)`
        pairs for a list, in the order they are produced. Closing a stream before its end
        (`close()`, or dropping it mid-way) cancels the requests it still waits for."""
        if isinstance(prompt, str):
            result = self.submit(prompt, **kwargs)
            return self._stream(result) if stream else result.wait_completion()
        results = [self.submit(p, **kwargs) for p in prompt]
        if not stream:
            return [r.wait_completion() for r in results]
        return self._interleave(results)

    def _stream(self, result: GenerateResult) -> Generator[str, None, None]:
        try:
            yield from result
        finally:
            if not result.done:
                self.cancel(result)

    def _interleave(self, results: list[GenerateResult]) -> Generator[tuple[int, str], None, None]:
        cond = threading.Condition()
        woken: dict[int, None] = dict.fromkeys(range(len(results)))  # catch up on all first

        def wake(i: int) -> None:  # on the loop thread: no text is decoded there
            with cond:
                woken[i] = None
                cond.notify()

        for i, r in enumerate(results):
            r.listen(lambda i=i: wake(i))
        starts, remaining = [0] * len(results), len(results)
        try:
            while remaining:
                with cond:
                    cond.wait_for(lambda: woken)
                    batch = list(woken)
                    woken.clear()
                for i in batch:
                    if starts[i] < 0:
                        continue  # ended already
                    pieces, starts[i], done = results[i].take(starts[i])
                    for text, _ in pieces:
                        yield i, text
                    if done:
                        starts[i], remaining = -1, remaining - 1
        finally:
            for r in results:
                if not r.done:
                    self.cancel(r)

    async def generate_async(
        self, prompt: str | Sequence[int], **kwargs: Any
    ) -> AsyncGenerator[str, None]:
        """Async text deltas; the event loop is never blocked and no thread is held per stream.

        The engine's thread only wakes the event loop (once per step, `Handoff`); the text is
        decoded here, and a consumer that falls behind gets several tokens' text at once."""
        loop = asyncio.get_running_loop()
        ready = asyncio.Event()
        result = self.submit(prompt, **kwargs)
        result.listen(lambda: self.handoff.post(loop, ready.set))
        start = 0
        try:
            while True:
                ready.clear()
                pieces, start, done = result.take(start)
                if pieces:
                    yield "".join(text for text, _ in pieces)
                if done:
                    break
                if not pieces:
                    await ready.wait()
        finally:
            if not result.done:
                self.cancel(result)
        result.raise_if_failed()

    # ------------------------------------------------------------------ rollouts and weights
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
        logprobs_mode: str = "raw",
        structured: StructuredOutput | Sequence[StructuredOutput | None] | None = None,
    ) -> list[Any]:
        """Generate for every prompt on the calling thread; results in input order.

        Returns token-id lists, or `(ids, logprobs)` pairs with `return_logprobs`, or
        `BatchResult`s with `return_details`. Prompt `i` draws with seed `seed + i` (any int:
        seeds are used mod 2**64). A rejected prompt (empty, too long, `max_tokens <= 0`,
        KV allocation failed) gets finish reason `rejected` and an error; a request that
        faults (see `step`) gets `aborted`; neither blocks the others. Invalid
        sampling settings raise ValueError. The background loop is paused for the call.
        `logprobs_mode` (`raw`, `scaled`, `processed`: see `astrai.inference.sampling`)
        picks the distribution the log-probs are of; RL wants `scaled` (its trainer's
        forward divides the logits by the sampling temperature too). `structured`: one output
        constraint for every prompt, or one per prompt (`astrai.inference.structured`).
        """
        params = SamplingParams(
            temperature=temperature,
            top_p=top_p,
            top_k=top_k,
            frequency_penalty=frequency_penalty,
            max_tokens=max_tokens,
            ignore_eos=ignore_eos,
            logprobs_mode=logprobs_mode,
        )
        backend = selected_backend()
        constraints = per_prompt(structured, len(prompt_ids_list))
        checked: list[tuple[Task, str | None]] = []
        for i, ids in enumerate(prompt_ids_list):  # every check before anything runs
            p = params if seed is None else dataclasses.replace(params, seed=seed + i)
            if constraints[i] is not None:
                p = dataclasses.replace(p, structured=constraints[i])
            task = Task(prompt_ids=list(ids), params=p, backend=backend)
            try:
                self.check_request(task.prompt_ids, p)
                checked.append((task, None))
            except RequestRejected as err:
                checked.append((task, str(err)))
        tasks = [task for task, _ in checked]
        self._run_here([checked])
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

    def score(
        self,
        requests: Sequence[tuple[Sequence[int], Sequence[int]]],
        *,
        top_logprobs: int = 0,
        progress: bool = False,
    ) -> list[ScoreResult]:
        """Log-likelihood of each continuation given its context, on the calling thread.

        `requests`: `(context_ids, continuation_ids)` pairs, both non-empty, together at most
        `max_seq_len` tokens. Returns one `ScoreResult` per request, in input order: the
        summed log-prob, whether every continuation token is its position's argmax, and
        each token's `TokenLogprob` with `top_logprobs` alternatives. Nothing is sampled.
        A bad request raises ValueError naming its index before any work. With a radix
        prefix cache, the first request of each context runs first and the others reuse
        the whole KV pages of its context before the last context token.
        """
        if isinstance(top_logprobs, bool) or not isinstance(top_logprobs, int):
            raise ValueError(f"top_logprobs must be an int, got {top_logprobs!r}")
        if not 0 <= top_logprobs <= MAX_LOGPROBS:
            raise ValueError(f"top_logprobs must be in [0, {MAX_LOGPROBS}], got {top_logprobs}")
        pairs = check_score_requests(
            requests, max_seq_len=self.max_seq_len, vocab_size=self.vocab_size
        )
        backend = selected_backend()
        tasks = []
        for i, (context, continuation) in enumerate(pairs):
            params = SamplingParams(
                max_tokens=0, prompt_logprobs=top_logprobs, prompt_logprobs_start=len(context)
            )
            task = Task(prompt_ids=context + continuation, params=params, backend=backend)
            try:
                self.check_request(task.prompt_ids, params)
            except ValueError as err:
                raise ValueError(f"request {i}: {err}") from None
            tasks.append(task)
        phases = score_phases([c for c, _ in pairs], self.pool.shares_prefixes)
        with tqdm(
            total=len(tasks), desc="score", unit="req", disable=None if progress else True
        ) as bar:
            for t in tasks:
                t.on_finish = lambda _, bar=bar: bar.update(1)
            self._run_here([[(tasks[i], None) for i in phase] for phase in phases])
        results = []
        for i, (t, (context, _)) in enumerate(zip(tasks, pairs)):
            if t.finish_reason != "length":
                raise RuntimeError(f"request {i} {t.finish_reason}: {t.error}")
            results.append(score_result(t, len(context)))
        return results

    def _run_here(self, phases: Sequence[Sequence[tuple[Task, str | None]]]) -> None:
        """Run checked tasks (with their rejection, if any) to the end on this thread, one
        phase after the other; the background loop is paused meanwhile."""
        was_running = self.running
        if was_running:
            self._pause()
        try:
            for phase in phases:
                for task, rejection in phase:
                    self._queue(task, rejection)
                while self.scheduler.has_work():
                    self.step()
        finally:
            self.handoff.flush()
            if was_running and not self._closed:
                self.start()

    def update_weights(
        self, fn: Callable[[], Any] | None = None, version: int | None = None
    ) -> int:
        """Apply `fn` (e.g. copy new weights in) with the loop paused; advance the policy
        version to `version` (default: current + 1; an explicit one must be greater)."""
        was_running = self.running
        if was_running:
            self._pause()
        try:
            return self.scheduler.apply_weight_update(version, fn or (lambda: None))
        finally:
            if was_running and not self._closed:
                self.start()


def _params(params: SamplingParams | None, overrides: dict[str, Any]) -> SamplingParams:
    """`params` with keyword overrides (or a fresh `SamplingParams` from the keywords)."""
    if params is None:
        return SamplingParams(**overrides)
    return dataclasses.replace(params, **overrides) if overrides else params
