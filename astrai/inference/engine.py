"""`InferenceEngine`: text in, text out, over a scheduler that plans and a runner that runs.

Three callers share it: the HTTP server (`generate_async` / `submit` / `submit_group`),
evaluation (`run_batch`, and `score` for log-likelihoods), and GRPO rollouts (`run_batch`,
token ids and log-probs). `SamplingParams.n` samples of one prompt run as a group that
prefills the prompt once (`astrai.inference.groups`).
Its step is nano-vllm's: `scheduler.schedule()` -> `runner.run(plan)` (a `StepOutput`) ->
`scheduler.postprocess(plan, out)`, driven by one background thread or, for `run_batch`, by the
calling thread; both use `step()`.
"""

from __future__ import annotations

import logging
import os
from collections.abc import AsyncGenerator, Callable, Generator, Mapping, Sequence
from typing import Any, Literal

import torch

from astrai.extension import BackendUnavailable, selected_backend
from astrai.inference.adapters import AdapterInfo, EngineAdapters, LoRASettings, NoAdapters
from astrai.inference.batch import BatchResult, batch_output, group_tasks, prompt_groups, single
from astrai.inference.engine_options import check_engine_arguments
from astrai.inference.errors import EngineNotReady, RequestRejected
from astrai.inference.grammar import grammar_compiler
from astrai.inference.graph import DecodeGraphRunner
from astrai.inference.handoff import Handoff
from astrai.inference.logprobs import ScoreResult
from astrai.inference.loop import EngineLoop
from astrai.inference.params import SamplingParams, params_from
from astrai.inference.parts import kv_pool, make_proposer, projection_packs
from astrai.inference.result import GenerateResult, interleave, stream_deltas, stream_text
from astrai.inference.runner import ModelRunner
from astrai.inference.scheduler import InferenceScheduler
from astrai.inference.scoring import (
    check_score_requests,
    score_params,
    score_phases,
    score_progress,
    score_result,
    score_tasks,
)
from astrai.inference.sleep import EngineSleeping, SleepMode
from astrai.inference.speculative import Proposer, SpeculativeConfig
from astrai.inference.structured import StructuredOutput
from astrai.inference.task import Rejection, Task
from astrai.model import Transformer
from astrai.model.factory import check_vocab
from astrai.tokenizer import AutoTokenizer

logger = logging.getLogger(__name__)

__all__ = [
    "BatchResult",
    "EngineNotReady",
    "EngineSleeping",
    "GenerateResult",
    "InferenceEngine",
    "RequestRejected",
]


class InferenceEngine:
    """A model, its tokenizer, a KV pool, a scheduler, a model runner and a loop thread.

    `cache_mode="contiguous"` (default) gives every batch slot `max_seq_len` fixed KV slots;
    `"paged"` shares a pool of `page_size`-token pages (budget `kv_tokens` or `memory_fraction`
    of free memory) with radix prefix sharing when `page_size > 1` (`prefix_cache=False` turns
    it off, `True` forces it on). `logprob_chunk` bounds the prompt positions whose
    full-vocabulary logits exist at once (prompt log-probs, `score`).
    `stream_interval` (seconds): streamed text may wait that long to leave with the next
    steps' (first tokens and ends never wait; `astrai.inference.handoff`); 0: every step.
    `max_prompt_tokens` rejects longer prompts (None: the context is the only limit): the
    server's cap, applied by the one prompt check every caller goes through.
    `packed_projections`: q/k/v and gate/up as one product each, on the fp32 CPU every matmul
    from oneDNN-prepacked weights (copies: `astrai.model.packed`; False saves that memory).
    `lora` (`LoRASettings`): LoRA adapters, one per request (`astrai.inference.adapters`).
    `speculative` (`SpeculativeConfig`): speculative decoding (`astrai.inference.speculative`).
    `enable_sleep_mode`: `sleep()` frees the KV pool, packs and decode graphs while the engine
    is idle (a trainer's optimizer step), `wake_up()` takes them back (`astrai.inference.sleep`).
    vLLM's names, each explained by its module (checked by `astrai.inference.engine_options`):
    `batch_invariant` (`VLLM_BATCH_INVARIANT`: each request's tokens and log-probs independent
    of the rest of the step; what it refuses: `astrai.inference.batch_invariance`);
    `quantization` ("int8_weight_only" packs; the model's parameters never change:
    `astrai.extension.quantized`); `kv_cache_dtype` ("auto", "int8":
    `astrai.inference.cache.kv_dtype`); `scheduling_policy` ("fcfs", "priority": lower
    `SamplingParams.priority` first; `astrai.inference.priority`).
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
        max_prompt_tokens: int | None = None,
        packed_projections: bool = True,
        lora: LoRASettings | Mapping[str, Any] | None = None,
        speculative: SpeculativeConfig | Mapping[str, Any] | None = None,
        enable_sleep_mode: bool = False,
        batch_invariant: bool = False,
        kv_cache_dtype: str = "auto",
        quantization: str | None = None,
        scheduling_policy: str = "fcfs",
        start: bool = True,
    ) -> None:
        checked = check_engine_arguments(  # before anything is allocated
            model.config,
            enable_sleep_mode=enable_sleep_mode,
            quantization=quantization,
            scheduling_policy=scheduling_policy,
            batch_invariant=batch_invariant,
            prefix_cache=prefix_cache,
            decode_graphs=decode_graphs,
            speculative=speculative,
            max_seq_len=max_seq_len,
            kv_cache_dtype=kv_cache_dtype,
        )
        invariance, self.quantization = checked.invariance, checked.quantization
        self.batch_invariant = invariance.enabled
        # No .eval() here: GRPO shares the live policy module, whose mode Lightning owns. The
        # model has no dropout; the runner runs it under inference_mode.
        self.model = model
        self.tokenizer = tokenizer
        cfg = model.config
        check_vocab(cfg.vocab_size, tokenizer, source="the model")
        self.packed_projections = bool(packed_projections)  # before a pool sized by free memory
        self.packs = projection_packs(
            model, self.packed_projections, self.quantization, max_batch_size
        )
        self.packs.hold()
        self.pool = kv_pool(
            model,
            max_batch_size=max_batch_size,
            max_seq_len=max_seq_len,
            cache_mode=cache_mode,
            page_size=page_size,
            kv_tokens=kv_tokens,
            memory_fraction=memory_fraction,
            prefix_cache=invariance.prefix_cache,
            kv_cache_dtype=kv_cache_dtype,
        )
        self.handoff = Handoff(stream_interval)
        self.adapters: EngineAdapters | NoAdapters = EngineAdapters.build(model, lora)
        slots = self.adapters.slots
        self.proposer: Proposer = make_proposer(speculative, model, max_batch_size, max_seq_len)
        self.scheduler = InferenceScheduler(
            self.pool,
            vocab_size=cfg.vocab_size,
            max_batch_size=max_batch_size,
            max_prefill_tokens=max_prefill_tokens,
            stop_ids=tokenizer.stop_ids,
            max_queue=max_queue,
            max_prompt_tokens=max_prompt_tokens,
            adapters=slots,
            speculative_tokens=self.proposer.num_speculative_tokens,
            batch_invariant=invariance.enabled,
            scheduling_policy=checked.scheduling_policy,
        )
        self.runner = ModelRunner(
            model,
            self.pool,
            max_batch_size=max_batch_size,
            decode_graphs=invariance.decode_graphs,
            logprob_chunk=logprob_chunk,
            grammar=grammar_compiler(tokenizer),
            adapters=slots,
            proposer=self.proposer,
            batch_invariant=invariance.enabled,
        )
        self.sleep_mode = SleepMode(
            enable_sleep_mode,
            pools=(self.pool, *self.proposer.kv_pools),
            graphs=self.runner,
            packs=self.packs,
            device=self.pool.device,
        )
        self.loop = EngineLoop(self.step, self.scheduler, self.handoff)
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
    def max_prompt_tokens(self) -> int | None:
        """The longest prompt accepted (None: what the context holds); see `check_request`."""
        return self.scheduler.max_prompt_tokens

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
        return self.loop.running

    @property
    def ready(self) -> bool:
        return not self.loop.closed and self.running and self.scheduler.failure is None

    def start(self) -> None:
        """Start the background loop (a restart after a crash accepts requests again); while
        asleep, at the wake-up."""
        if self.sleep_mode.asleep:
            self.sleep_mode.restart_loop = True
            return
        self.loop.start()

    def stop(self, timeout: float | None = 30.0) -> None:
        """Stop the loop after its current step; queued and running tasks stay as they are."""
        self.loop.stop(timeout)

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
                scheduler.postprocess(plan, out)
            scheduler.cleanup()
        finally:  # first tokens and ends go at once; other text within `stream_interval`
            self.handoff.end_step(urgent=scheduler.milestones != milestones)

    # ------------------------------------------------------------------ lifecycle
    def shutdown(self) -> None:
        """Stop the loop, end every open stream (finish reason `cancelled`) and give the KV
        pools and decode graphs back to the device (an engine built next finds them free)."""
        if self.loop.closed:
            return
        self.loop.close()
        self.packs.release()  # the last engine on this model drops the packs (not twice)
        self.adapters.close()  # LoRA slots' hooks
        self.proposer.close()  # a draft model's KV rows
        self.sleep_mode.close()  # the KV pools and graphs go back to the device

    def __enter__(self) -> InferenceEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    def get_stats(self) -> dict[str, Any]:
        """Counters since start (tasks, prompt / cached / generated tokens, steps,
        preemptions, finished_requests by reason, speculation's `spec_*`), current load
        (active_tasks, waiting_queue, kv_usage), the prefix cache's hit rate, `ttft_seconds` /
        `itl_seconds` histograms with recent p50 / p99: what `/metrics` exposes."""
        return {**self.scheduler.stats(), **self.sleep_mode.stats(), "ready": self.ready}

    # ------------------------------------------------------------------ sleep
    @property
    def is_sleeping(self) -> bool:
        return self.sleep_mode.asleep

    def sleep(self, level: int = 1) -> None:
        """Free the KV pool, the packed projections and the decode graphs (level 1; on CUDA
        the allocator's cache is emptied) until `wake_up`; the weights stay. Needs
        `enable_sleep_mode`; waits for the loop's running requests; a second call does
        nothing. Meanwhile `submit` queues (run after the wake-up) and `run_batch` / `score`
        raise `EngineSleeping` (`astrai.inference.sleep`)."""
        self.sleep_mode.check(level)
        if self.loop.closed:
            raise EngineNotReady("the engine has been shut down")
        if self.sleep_mode.asleep:
            return
        restart = self.loop.halt()
        try:
            self.sleep_mode.enter(level, restart)
        except BaseException:
            if restart:
                self.loop.start()
            raise

    def wake_up(self) -> None:
        """Take back what `sleep` freed (the pool as before, packs from the current weights,
        the graphs captured again) and restart the loop if it ran; awake or shut down: nothing."""
        if self.loop.closed or not self.sleep_mode.asleep:
            return
        if self.sleep_mode.leave():
            self.loop.start()

    def _awake(self, what: str) -> None:
        if self.sleep_mode.asleep:
            raise EngineSleeping(f"{what} on a sleeping engine: call wake_up() first")

    # ------------------------------------------------------------------ submission
    def encode(self, prompt: str | Sequence[int]) -> list[int]:
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt)
        return list(prompt)

    def check_request(self, prompt_ids: Sequence[int], params: SamplingParams) -> None:
        """The one request check, run once per request by `submit`, `run_batch` and `score`.

        Bad settings raise `ValueError` naming the parameter (`top_p must be ...`:
        `SamplingParams.validate`); a prompt that can never run raises `RequestRejected` (a
        `ValueError`) saying why, its `param` tagging the setting at fault
        (`InferenceScheduler.problem`).
        """
        params.validate(vocab_size=self.vocab_size)
        self.scheduler.check_priority(params.priority)  # vLLM: none under fcfs
        self.adapters.resolve(params.adapter)  # AdapterNotFound names it
        if params.structured is not None:  # compiled (and cached) now: a bad one is a 400
            grammar_compiler(self.tokenizer).compile(params.structured)
        problem = self.scheduler.problem(prompt_ids, params)
        if problem is not None:
            raise RequestRejected(problem)

    def _queue(self, tasks: Sequence[Task], rejection: str | Rejection | None) -> None:
        """Queue the tasks of one prompt as a group, or reject them all with `rejection`;
        with their adapter, resolved under the registry's lock (no unload in between)."""
        with self.adapters.lock:
            if rejection is None:
                rejection = self.adapters.assign(tasks)
            if rejection is None:
                self.scheduler.submit_group(tasks)
                return
        for task in tasks:
            self.scheduler.reject(task, rejection)

    def submit(
        self,
        prompt: str | Sequence[int],
        params: SamplingParams | None = None,
        **sampling: Any,
    ) -> GenerateResult:
        """Queue one request and return its `GenerateResult` at once.

        Settings come as `params`; any `SamplingParams` field given as a keyword overrides
        it (a convenience: `submit(p, max_tokens=8)`). A seed may be any int (it is used
        mod 2**64). One sequence: `n > 1` is a ValueError (`submit_group` runs those).
        Invalid settings raise `ValueError` naming the parameter before anything is queued;
        a prompt that can never run ends at once with finish reason `rejected` (see
        `check_request`).
        """
        params = single(params_from(params, sampling), "submit")
        return self.submit_group(prompt, params)[0]

    def submit_group(
        self,
        prompt: str | Sequence[int],
        params: SamplingParams | None = None,
        **sampling: Any,
    ) -> list[GenerateResult]:
        """Queue the `params.n` samples of one prompt as one group; their results, in order.

        Sample `j` draws with seed `seed + j` (with a seed). With a prefix cache, the prompt
        is prefilled once: the other samples wait for the first one's prefill and then
        compute only the prompt's last partial page (`astrai.inference.groups`). Checks as
        `submit`'s, once for the group: a prompt that can never run rejects every sample
        with the same `Rejection`.
        """
        if self.loop.closed:
            raise EngineNotReady("the engine has been shut down")
        params = params_from(params, sampling)
        prompt_ids = self.encode(prompt)
        rejection = None
        try:
            self.check_request(prompt_ids, params)  # bad settings raise: nothing is queued
        except RequestRejected as err:
            rejection = err.rejection
        tasks = group_tasks(prompt_ids, params, selected_backend())
        results = [GenerateResult.attached(task, self.tokenizer) for task in tasks]
        self._queue(tasks, rejection)
        return results

    def cancel(self, result: GenerateResult | int) -> bool:
        return self.scheduler.cancel_task(result if isinstance(result, int) else result.id)

    # ------------------------------------------------------------------ generate
    def generate(
        self,
        prompt: str | Sequence[str],
        params: SamplingParams | None = None,
        *,
        stream: bool = False,
        **sampling: Any,
    ) -> (
        str
        | list[str]
        | list[list[str]]
        | Generator[str, None, None]
        | Generator[tuple[int, str], None, None]
    ):
        """str -> str; list -> list[str]; `stream=True`: text deltas, or `(index, delta)`
        pairs for a list, in the order they are produced. Closing a stream before its end
        (`close()`, or dropping it mid-way) cancels the requests it still waits for.
        Settings: as `submit`'s. With `n > 1` each prompt is a group (`submit_group`, seeds
        `seed + j`): a str gives a list of `n` texts, a list a list of such lists, and a
        stream `(i * n + j, delta)` pairs (prompt `i`, sample `j`)."""
        params = params_from(params, sampling)
        if params.n == 1 and isinstance(prompt, str):
            result = self.submit(prompt, params)
            return stream_text(result, self.cancel) if stream else result.wait_completion()
        prompts = [prompt] if isinstance(prompt, str) else list(prompt)
        groups = [self.submit_group(p, params) for p in prompts]
        if stream:
            return interleave([r for group in groups for r in group], self.cancel)
        texts = [[r.wait_completion() for r in group] for group in groups]
        if params.n == 1:
            return [group[0] for group in texts]
        return texts[0] if isinstance(prompt, str) else texts

    async def generate_async(
        self, prompt: str | Sequence[int], params: SamplingParams | None = None, **sampling: Any
    ) -> AsyncGenerator[str, None]:
        """Async text deltas; the event loop is never blocked and no thread is held per stream.
        Settings: as `submit`'s.

        The engine's thread only wakes the event loop (once per step, `Handoff`); the text is
        decoded here, and a consumer that falls behind gets several tokens' text at once."""
        result = self.submit(prompt, single(params_from(params, sampling), "generate_async"))
        deltas = stream_deltas(result, self.handoff, self.cancel)
        try:
            async for delta in deltas:
                yield delta
        finally:  # a consumer that stops early closes this stream: cancel its request
            await deltas.aclose()

    # ------------------------------------------------------------------ rollouts and weights
    def run_batch(
        self,
        prompt_ids_list: Sequence[Sequence[int]],
        params: SamplingParams | None = None,
        *,
        return_logprobs: bool = False,
        return_details: bool = False,
        structured: StructuredOutput | Sequence[StructuredOutput | None] | None = None,
        on_group: Callable[[int, list[BatchResult]], None] | None = None,
        **sampling: Any,
    ) -> list[Any]:
        """Generate for every prompt on the calling thread; results in input order.

        Settings: as `submit`'s (`params`, any field as a keyword). With a seed, prompt `i`
        draws with seed `seed + i` (any int: seeds are used mod 2**64). `params.n > 1`:
        `len(prompts) * n` results, prompt-major (result `i * n + j` is sample `j` of prompt
        `i`, seed `seed + i * n + j`), each prompt's samples one group that prefills it once
        (`submit_group`). `structured`: one output constraint for every prompt, or one per
        prompt (`astrai.inference.structured`); None: `params.structured`. Returns token-id
        lists, `(ids, logprobs)` pairs (`return_logprobs`) or `BatchResult`s
        (`return_details`); `on_group(i, results)` as soon as prompt `i`'s finish
        (`watch_groups`). A rejected prompt gets finish reason `rejected` and an error, a
        faulting request `aborted`; neither blocks the others. Invalid settings raise
        ValueError before anything runs. The background loop is paused for the call. RL
        wants `logprobs_mode="scaled"` (its trainer's forward divides by the temperature too).
        """
        self._awake("run_batch")
        params = params_from(params, sampling).validate(vocab_size=self.vocab_size)
        groups = prompt_groups(
            prompt_ids_list, params, structured, self._checked, selected_backend(), on_group
        )
        self._run_here([groups])
        return [
            batch_output(t, return_logprobs=return_logprobs, return_details=return_details)
            for tasks, _ in groups
            for t in tasks
        ]

    def score(
        self,
        requests: Sequence[tuple[Sequence[int], Sequence[int]]],
        params: SamplingParams | None = None,
        *,
        top_logprobs: int | None = None,
        progress: bool = False,
    ) -> list[ScoreResult]:
        """Log-likelihood of each continuation given its context, on the calling thread.

        `requests`: `(context_ids, continuation_ids)` pairs, both non-empty, together at most
        `max_seq_len` tokens. Returns one `ScoreResult` per request, in input order: the
        summed log-prob, whether every continuation token is its position's argmax, and
        each token's `TokenLogprob` with `params.prompt_logprobs` alternatives (None: 0;
        `top_logprobs`, when given, overrides it). Nothing is sampled: `max_tokens` and
        `prompt_logprobs_start` are set here. A bad request raises ValueError naming its
        index before any work. With a radix prefix cache, the first request of each context
        runs first and the others reuse the whole KV pages of its context before the last
        context token.
        """
        self._awake("score")
        base = score_params(params, top_logprobs)
        self.adapters.resolve(base.adapter)  # AdapterNotFound before any work, as submit's
        pairs = check_score_requests(
            requests, max_seq_len=self.max_seq_len, vocab_size=self.vocab_size
        )
        tasks = score_tasks(pairs, base, self.check_request, selected_backend())
        phases = score_phases([c for c, _ in pairs], self.pool.shares_prefixes)
        with score_progress(tasks, progress):
            self._run_here([[([tasks[i]], None) for i in phase] for phase in phases])
        return [
            score_result(i, t, len(context))
            for i, (t, (context, _)) in enumerate(zip(tasks, pairs))
        ]

    def _checked(self, prompt_ids: list[int], params: SamplingParams) -> Rejection | None:
        """`check_request`, with a prompt that can never run as its `Rejection`."""
        try:
            self.check_request(prompt_ids, params)
        except RequestRejected as err:
            return err.rejection
        return None

    def _run_here(self, phases: Sequence[Sequence[tuple[list[Task], Rejection | None]]]) -> None:
        """Run checked groups of tasks (with their rejection, if any) to the end on this
        thread, one phase after the other; the background loop is paused meanwhile."""

        def queue(phase: Sequence[tuple[list[Task], Rejection | None]]) -> Callable[[], None]:
            return lambda: [self._queue(tasks, rejection) for tasks, rejection in phase]

        self.loop.run_here([queue(phase) for phase in phases])

    def update_weights(
        self, fn: Callable[[], Any] | None = None, version: int | None = None
    ) -> int:
        """Apply `fn` (e.g. copy new weights in) with the loop paused; advance the policy
        version to `version` (default: current + 1; an explicit one must be greater)."""

        def apply() -> None:
            if fn is not None:
                fn()
            self.adapters.refresh_live()  # a training run's live adapter is read again

        with self.loop.paused():
            return self.scheduler.apply_weight_update(version, apply)

    # ------------------------------------------------------------------ LoRA adapters
    @property
    def lora_enabled(self) -> bool:
        return self.adapters.enabled

    def load_adapter(self, name: str, path: str | os.PathLike) -> AdapterInfo:
        """Register the PEFT-layout adapter at `path` (ours or PEFT's) as `name`, while
        serving; an `AdapterError` names the file and the limit it breaks."""
        return self.adapters.load(name, path)

    def unload_adapter(self, name: str) -> None:
        """Forget adapter `name`; `AdapterInUse` while queued or running requests use it."""
        self.adapters.unload(name, self.scheduler.uses_adapter)

    def list_adapters(self) -> list[AdapterInfo]:
        return self.adapters.list()
