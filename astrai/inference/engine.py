"""`InferenceEngine`: text in, text out, over the continuous-batching scheduler.

Three callers share it: the HTTP server (`generate_async` / `submit`), generation-based
evaluation during training, and GRPO rollouts (`run_batch`, token ids and log-probs).
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import AsyncGenerator, Callable, Generator, Iterator, Sequence
from typing import Any, Literal

import torch

from astrai.inference.cache import PagePool
from astrai.inference.graph import (
    CUDAGraphRunner,
    DecodeGraphRunner,
    StandInGraphRunner,
    capture_sizes,
)
from astrai.inference.sampling import SamplingParams
from astrai.inference.scheduler import InferenceScheduler
from astrai.inference.task import Task
from astrai.inference.workspace import InferenceWorkspace
from astrai.model import Transformer
from astrai.tokenizer import AutoTokenizer

logger = logging.getLogger(__name__)


class EngineNotReady(RuntimeError):
    """The engine was shut down, or its loop crashed."""


class GenerateResult:
    """Progress of one request, filled in by the scheduler thread.

    Non-streaming callers block on a `Condition` (`wait_completion`); streaming callers
    wait on an `Event` that is set whenever new text arrives (`wait`), or iterate.
    `callbacks` receive each text delta as it is produced (`cb(text)`).
    """

    def __init__(self, task: Task, tokenizer: AutoTokenizer) -> None:
        self.task = task
        self._decoder = tokenizer.stream_decoder(skip_special_tokens=True)
        self._special = set(tokenizer.special_ids)
        self._pieces: list[str] = []
        self._read = 0
        self._cond = threading.Condition()
        self._event = threading.Event()
        self._done = False
        self.callbacks: list[Callable[[str], None]] = []
        self.finish_callbacks: list[Callable[[GenerateResult], None]] = []

    # -- scheduler side
    def _on_token(self, task: Task, token: int, logprob: float) -> None:
        text = self._decoder.step(token)
        self._push(text)

    def _on_finish(self, task: Task) -> None:
        self._push(self._decoder.flush())
        # Callbacks run under the lock, so one registered concurrently (see
        # `_interleave`) sees each piece exactly once: in the snapshot or as a call.
        with self._cond:
            self._done = True
            self._cond.notify_all()
            for cb in self.finish_callbacks:
                cb(self)
        self._event.set()

    def _push(self, text: str) -> None:
        if not text:
            return
        with self._cond:
            self._pieces.append(text)
            self._cond.notify_all()
            for cb in self.callbacks:
                cb(text)
        self._event.set()

    # -- caller side
    @property
    def id(self) -> int:
        return self.task.id

    @property
    def done(self) -> bool:
        return self._done

    @property
    def text(self) -> str:
        return "".join(self._pieces)

    @property
    def token_ids(self) -> list[int]:
        return list(self.task.output_ids)

    @property
    def finish_reason(self) -> str | None:
        return self.task.finish_reason

    def wait(self, timeout: float | None = None) -> bool:
        """Block until new text or the end arrives; True if something did."""
        got = self._event.wait(timeout)
        self._event.clear()
        return got

    def wait_completion(self, timeout: float | None = None) -> str:
        with self._cond:
            if not self._cond.wait_for(lambda: self._done, timeout):
                raise TimeoutError(f"request {self.id} did not finish within {timeout} s")
        if self.task.finish_reason in ("rejected", "aborted"):
            raise ValueError(f"request {self.id} {self.task.finish_reason}: {self.task.error}")
        return self.text

    def __iter__(self) -> Iterator[str]:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._read < len(self._pieces) or self._done)
                pieces = self._pieces[self._read :]
                self._read = len(self._pieces)
                done = self._done
            yield from pieces
            if done and self._read == len(self._pieces):
                if self.task.finish_reason in ("rejected", "aborted"):
                    raise ValueError(
                        f"request {self.id} {self.task.finish_reason}: {self.task.error}"
                    )
                return


class InferenceEngine:
    """A model, its tokenizer, a KV pool and a scheduler thread.

    `cache_mode="contiguous"` (default) gives every batch slot `max_seq_len` fixed KV
    slots; `"paged"` shares a pool of `page_size`-token pages (budget `kv_tokens` or
    `memory_fraction` of free memory) with radix prefix sharing when `page_size > 1`
    (`prefix_cache=False` turns it off, `True` forces it on).
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
        start: bool = True,
    ) -> None:
        # No .eval() here: GRPO shares the live policy module, whose mode Lightning owns. The
        # model has no dropout; the scheduler runs it under inference_mode.
        self.model = model
        self.tokenizer = tokenizer
        param = next(model.parameters())
        cfg = model.config
        if len(tokenizer) > cfg.vocab_size:
            raise ValueError(
                f"tokenizer has {len(tokenizer)} tokens but the model's vocab_size is {cfg.vocab_size}"
            )
        max_seq_len = max_seq_len or min(cfg.max_position_embeddings, 4096)
        self.pool = PagePool(
            num_layers=cfg.num_hidden_layers,
            num_kv_heads=cfg.num_key_value_heads,
            head_dim=cfg.head_dim,
            dtype=param.dtype,
            device=param.device,
            max_batch_size=max_batch_size,
            max_seq_len=max_seq_len,
            mode=cache_mode,
            page_size=page_size,
            kv_tokens=kv_tokens,
            memory_fraction=memory_fraction,
            enable_radix=prefix_cache,
        )
        self.scheduler = InferenceScheduler(
            model,
            self.pool,
            max_batch_size=max_batch_size,
            max_prefill_tokens=max_prefill_tokens,
            stop_ids=tokenizer.stop_ids,
            max_queue=max_queue,
        )
        self.graph_runner = self._build_graph_runner(decode_graphs, max_batch_size)
        self._closed = False
        if start:
            self.scheduler.start()

    def _build_graph_runner(
        self, mode: bool | str | None, max_batch_size: int
    ) -> DecodeGraphRunner | None:
        """CUDA graphs for decode by default on CUDA; `"stand-in"` for CPU tests; False: eager."""
        device = self.pool.device
        if mode is None:
            mode = device.type == "cuda"
        if not mode:
            return None
        cfg = self.model.config
        if (cfg.rope_scaling or {}).get("rope_type") == "dynamic":
            logger.warning("decode graphs disabled: dynamic RoPE depends on the step's length")
            return None
        batch = min(max_batch_size, self.pool.req_pool.num_reqs)
        workspace = InferenceWorkspace(
            self.pool,
            max_batch_size=batch,
            n_heads=cfg.num_attention_heads,
            head_dim=cfg.head_dim,
            dtype=next(self.model.parameters()).dtype,
        )
        sizes = capture_sizes(batch)
        if mode == "stand-in":
            runner: DecodeGraphRunner = StandInGraphRunner(self.model, workspace, sizes)
        elif device.type != "cuda":
            raise ValueError(f"decode_graphs=True needs a CUDA model, got {device}")
        else:
            try:
                runner = CUDAGraphRunner(self.model, workspace, sizes)
            except Exception as err:  # fall back to eager decode, loudly
                logger.warning("CUDA graph capture failed, decoding eagerly: %s", err)
                return None
        self.scheduler.workspace = workspace
        self.scheduler.graph_runner = runner
        return runner

    @property
    def cuda_graph_enabled(self) -> bool:
        return isinstance(self.graph_runner, CUDAGraphRunner)

    # ------------------------------------------------------------------ lifecycle
    @property
    def ready(self) -> bool:
        return not self._closed and self.scheduler.ready

    def shutdown(self) -> None:
        """Stop the loop and end every open stream (finish reason `cancelled`)."""
        if self._closed:
            return
        self._closed = True
        with self.scheduler._lock:
            pending = [*self.scheduler._waiting, *self.scheduler._running]
        for task in pending:
            self.scheduler.cancel_task(task.id)
        deadline = 50
        while self.scheduler.running and self.scheduler.has_work() and deadline:
            threading.Event().wait(0.02)
            deadline -= 1
        self.scheduler.stop()
        if self.scheduler.has_work():  # loop was not running: clean up on this thread
            self.scheduler._cleanup()

    def __enter__(self) -> InferenceEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    def get_stats(self) -> dict[str, Any]:
        return self.scheduler.stats()

    # ------------------------------------------------------------------ submission
    def encode(self, prompt: str | Sequence[int]) -> list[int]:
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt)
        return list(prompt)

    def submit(
        self,
        prompt: str | Sequence[int],
        *,
        max_tokens: int = 256,
        ignore_eos: bool = False,
        stop_ids: Sequence[int] | None = None,
        **sampling: Any,
    ) -> GenerateResult:
        """Queue one request and return its `GenerateResult` at once.

        Sampling keywords are `SamplingParams` fields (temperature, top_p, top_k, min_p,
        presence_penalty, frequency_penalty, logit_bias, seed); invalid values raise
        `ValueError` naming the parameter before anything is queued.
        """
        if self._closed:
            raise EngineNotReady("the engine has been shut down")
        params = SamplingParams(**sampling)
        params.validate()
        stops = frozenset(self.tokenizer.stop_ids if stop_ids is None else stop_ids)
        task = Task(
            prompt_ids=self.encode(prompt),
            params=params,
            max_tokens=max_tokens,
            stop_ids=stops,
            ignore_eos=ignore_eos,
        )
        result = GenerateResult(task, self.tokenizer)
        task.on_token = result._on_token
        task.on_finish = result._on_finish
        self.scheduler.submit(task)
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
        pairs for a list, in the order they are produced."""
        if isinstance(prompt, str):
            result = self.submit(prompt, **kwargs)
            return iter(result) if stream else result.wait_completion()
        results = [self.submit(p, **kwargs) for p in prompt]
        if not stream:
            return [r.wait_completion() for r in results]
        return self._interleave(results)

    @staticmethod
    def _interleave(results: list[GenerateResult]) -> Generator[tuple[int, str], None, None]:
        cond = threading.Condition()
        events: list[tuple[int, str | None]] = []

        def make(i: int) -> tuple[Callable[[str], None], Callable[[GenerateResult], None]]:
            def on_text(text: str) -> None:
                with cond:
                    events.append((i, text))
                    cond.notify()

            def on_done(_: GenerateResult) -> None:
                with cond:
                    events.append((i, None))
                    cond.notify()

            return on_text, on_done

        for i, r in enumerate(results):
            on_text, on_done = make(i)
            with r._cond:  # register atomically with respect to delivered text
                r.callbacks.append(on_text)
                r.finish_callbacks.append(on_done)
                early, finished = list(r._pieces), r._done
            for text in early:
                events.append((i, text))
            if finished:
                events.append((i, None))
        remaining = len(results)
        while remaining:
            with cond:
                cond.wait_for(lambda: events)
                batch, events[:] = list(events), []
            for i, text in batch:
                if text is None:
                    remaining -= 1
                else:
                    yield i, text

    async def generate_async(
        self, prompt: str | Sequence[int], **kwargs: Any
    ) -> AsyncGenerator[str, None]:
        """Async text deltas; the event loop is never blocked and no thread is held per stream."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[str | None] = asyncio.Queue()
        result = self.submit(prompt, **kwargs)
        with result._cond:
            early, finished = list(result._pieces), result._done
            result.callbacks.append(lambda text: loop.call_soon_threadsafe(queue.put_nowait, text))
            result.finish_callbacks.append(
                lambda _: loop.call_soon_threadsafe(queue.put_nowait, None)
            )
        for text in early:
            queue.put_nowait(text)
        if finished:
            queue.put_nowait(None)
        try:
            while (text := await queue.get()) is not None:
                yield text
        finally:
            if not result.done:
                self.cancel(result)
        if result.finish_reason in ("rejected", "aborted"):
            raise ValueError(f"request {result.id} {result.finish_reason}: {result.task.error}")

    # ------------------------------------------------------------------ rollouts and weights
    def run_batch(self, prompt_ids_list: Sequence[Sequence[int]], **kwargs: Any) -> list[Any]:
        """Synchronous generation on the calling thread (see `InferenceScheduler.run_batch`).

        The background loop is paused for the call and resumed afterwards.
        """
        was_running = self.scheduler.running
        if was_running:
            self._pause()
        try:
            return self.scheduler.run_batch(prompt_ids_list, **kwargs)
        finally:
            if was_running and not self._closed:
                self.scheduler.start()

    def update_weights(
        self, fn: Callable[[], Any] | None = None, version: int | None = None
    ) -> int:
        """Apply `fn` (e.g. copy new weights in) with the loop paused; bump the policy version."""
        was_running = self.scheduler.running
        if was_running:
            self._pause()
        try:
            return self.scheduler.apply_weight_update(version, fn or (lambda: None))
        finally:
            if was_running and not self._closed:
                self.scheduler.start()

    def _pause(self) -> None:
        while self.scheduler.has_work():
            threading.Event().wait(0.01)
            if not self.scheduler.running:
                break
        self.scheduler.stop()

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device
