"""`GenerateResult`: one request's text as it is produced, for blocking, iterating or subscribing.

The engine's loop thread only records tokens (the task's `output_ids`) and wakes whoever
follows the request; the text is detokenized by the reader, on the reader's thread, when it
asks (`take`, `text`, iteration). On a 2-core machine the loop thread's Python time is the
scheduler's critical path, so incremental detokenization there (two tokenizer calls and
a lock per token) used to cost every request a few percent of throughput; on the reader's
side it runs while the loop thread is inside the model's kernels, and a reader that falls
behind decodes several tokens in one go.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncGenerator, Callable, Generator, Iterator, Sequence

from astrai.inference.handoff import Handoff
from astrai.inference.logprobs import TokenLogprob, TopLogprobs
from astrai.inference.task import Task
from astrai.tokenizer import AutoTokenizer

# One piece of text and the number of output tokens that exist once it is complete.
Piece = tuple[str, int]


class GenerateResult:
    """Progress of one request, fed by the engine's loop thread.

    Non-streaming callers block on `wait_completion`; streaming callers iterate, `wait` for
    new tokens, `listen` + `take` (the HTTP server and async streams: the loop thread only
    wakes them, they decode), or `subscribe` callbacks with the text. The loop thread feeds
    it through `on_token` / `on_finish` (set as the task's callbacks). Several requests
    followed by one thread: `interleave`.
    """

    def __init__(self, task: Task, tokenizer: AutoTokenizer) -> None:
        self.task = task
        self._decoder = tokenizer.stream_decoder(
            skip_special_tokens=task.params.skip_special_tokens
        )
        self._decode_lock = threading.Lock()
        self._pieces: list[Piece] = []
        self._decoded = 0  # output tokens fed to the decoder
        self._flushed = False
        self._cond = threading.Condition()
        self._waiters = 0  # threads blocked on `_cond`: the loop thread notifies only then
        self._seen = 0  # tokens (plus one at the end) that `wait` has reported
        self._done = False
        self._listeners: list[Callable[[], None]] = []
        self._subscribers: list[_Subscriber] = []
        self._sub_lock = threading.Lock()

    @classmethod
    def attached(cls, task: Task, tokenizer: AutoTokenizer) -> GenerateResult:
        """A result fed by `task`: the task's `on_token` / `on_finish` are this result's."""
        result = cls(task, tokenizer)
        task.on_token, task.on_finish = result.on_token, result.on_finish
        return result

    # -- loop side
    def on_token(self, task: Task, token: int, logprob: float) -> None:
        self._progress()

    def on_finish(self, task: Task) -> None:
        with self._cond:
            self._done = True
        self._progress()

    def _progress(self) -> None:
        if self._waiters:
            with self._cond:
                self._cond.notify_all()
        for wake in self._listeners:
            wake()
        if self._subscribers:
            self._feed_subscribers()

    # -- text, decoded on the reader's thread
    def take(self, start: int = 0) -> tuple[list[Piece], int, bool]:
        """Text pieces from piece `start` on, the next `start`, and whether the request is done
        (its whole text then included). New tokens are decoded here, on the calling thread;
        each piece comes with the number of output tokens that exist once it is complete."""
        done = self._done  # read before the tokens: once done, every token is in
        self._decode(done)
        pieces = self._pieces
        return pieces[start:], len(pieces), done

    def _decode(self, final: bool) -> None:
        ids = self.task.output_ids
        if self._decoded == len(ids) and (self._flushed or not final):
            return
        with self._decode_lock:
            n, step, pieces = len(ids), self._decoder.step, self._pieces
            for i in range(self._decoded, n):
                text = step(ids[i])
                if text:
                    pieces.append((text, i + 1))
            self._decoded = n
            if final and not self._flushed:
                self._flushed = True
                text = self._decoder.flush()
                if text:
                    pieces.append((text, n))

    def listen(self, wake: Callable[[], None]) -> None:
        """Call `wake()` on the loop thread after every new token and at the end; read them
        with `take`. `wake` must be cheap and must not block (e.g. post to an event loop);
        one that raises aborts this request only. Call before the first token, or `take`
        once after the call to catch up."""
        self._listeners.append(wake)

    def subscribe(
        self, on_text: Callable[[str], None], on_done: Callable[[GenerateResult], None]
    ) -> None:
        """Call `on_text` with every piece of text, in order, and `on_done` at the end.

        Text produced before the call is delivered at once (and the end, if it came), each
        piece exactly once. Later callbacks run on the loop thread (which then decodes this
        request's text: `listen` + `take` leave that to the reader): keep them short and
        never block in them.
        """
        sub = _Subscriber(on_text, on_done)
        with self._sub_lock:
            self._subscribers.append(sub)
        self._feed_subscribers()

    def _feed_subscribers(self) -> None:
        with self._sub_lock:  # one feeder at a time: each piece reaches each subscriber once
            for sub in self._subscribers:
                pieces, sub.start, done = self.take(sub.start)
                for text, _ in pieces:
                    sub.on_text(text)
                if done and not sub.ended:
                    sub.ended = True
                    sub.on_done(self)

    # -- caller side
    @property
    def id(self) -> int:
        return self.task.id

    @property
    def done(self) -> bool:
        return self._done

    @property
    def text(self) -> str:
        pieces, _, _ = self.take()
        return "".join(text for text, _ in pieces)

    @property
    def token_ids(self) -> list[int]:
        return list(self.task.output_ids)

    @property
    def finish_reason(self) -> str | None:
        return self.task.finish_reason

    @property
    def logprobs(self) -> list[float]:
        """Log-probs of the generated tokens (the request's `logprobs_mode`; raw by default)."""
        return list(self.task.logprobs)

    @property
    def speculation(self) -> dict[str, int]:
        """Speculative decoding's figures for this request: tokens proposed and accepted."""
        spec = self.task.spec
        return {"proposed": spec.proposed, "accepted": spec.accepted}

    @property
    def top_logprobs(self) -> list[TopLogprobs]:
        """Per generated token, its `params.logprobs` most likely `(token_id, logprob)` under
        the raw distribution, descending (empty unless the request asked)."""
        return list(self.task.top_logprobs)

    @property
    def prompt_logprobs(self) -> list[TokenLogprob | None] | None:
        """Per prompt position, its token's `TokenLogprob` (None before
        `prompt_logprobs_start`); None when the request did not ask. Complete once the
        first token is out (or, for `max_tokens=0`, once done)."""
        lps = self.task.prompt_logprobs
        return None if lps is None else list(lps)

    def _count(self) -> int:
        return len(self.task.output_ids) + self._done

    def _block(self, ready: Callable[[], bool], timeout: float | None) -> bool:
        with self._cond:
            self._waiters += 1
            try:
                return self._cond.wait_for(ready, timeout)
            finally:
                self._waiters -= 1

    def wait(self, timeout: float | None = None) -> bool:
        """Block until new tokens or the end arrive (since the last `wait`); True if some did."""
        got = self._block(lambda: self._count() > self._seen, timeout)
        self._seen = self._count()
        return got

    def wait_completion(self, timeout: float | None = None) -> str:
        """The whole text; raises ValueError if the request was rejected or aborted."""
        if not self._block(lambda: self._done, timeout):
            raise TimeoutError(f"request {self.id} did not finish within {timeout} s")
        self.raise_if_failed()
        return self.text

    def raise_if_failed(self) -> None:
        """Raise ValueError naming the reason if the request was rejected or aborted."""
        if self.task.finish_reason in ("rejected", "aborted"):
            raise ValueError(f"request {self.id} {self.task.finish_reason}: {self.task.error}")

    def __iter__(self) -> Iterator[str]:
        start, seen = 0, 0
        while True:
            self._block(lambda seen=seen: self._count() > seen, None)
            seen = self._count()
            pieces, start, done = self.take(start)
            for text, _ in pieces:
                yield text
            if done:
                self.raise_if_failed()
                return


def interleave(
    results: Sequence[GenerateResult], cancel: Callable[[GenerateResult], object]
) -> Generator[tuple[int, str], None, None]:
    """`(index, text delta)` pairs of several requests, in the order their text comes.

    One thread follows them all: the loop thread only marks which request moved (no text is
    decoded there), and this generator decodes on the caller's thread. Closing it before the
    end (`close()`, or dropping it) calls `cancel` on each request that is not done.
    """
    cond = threading.Condition()
    woken: dict[int, None] = dict.fromkeys(range(len(results)))  # catch up on all first

    def wake(i: int) -> None:  # on the loop thread
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
                cancel(r)


def stream_text(
    result: GenerateResult, cancel: Callable[[GenerateResult], object]
) -> Generator[str, None, None]:
    """`result`'s text deltas on this thread; closing the stream before its end cancels it."""
    try:
        yield from result
    finally:
        if not result.done:
            cancel(result)


async def stream_deltas(
    result: GenerateResult, handoff: Handoff, cancel: Callable[[GenerateResult], object]
) -> AsyncGenerator[str, None]:
    """`result`'s text deltas in the running event loop, which is never blocked and holds no
    thread per stream: the engine's thread only wakes it (once per step, `Handoff`); the
    text is decoded here, and a consumer that falls behind gets several tokens' text at
    once. Closing the stream before its end cancels the request."""
    loop = asyncio.get_running_loop()
    ready = asyncio.Event()
    result.listen(lambda: handoff.post(loop, ready.set))
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
            cancel(result)
    result.raise_if_failed()


class _Subscriber:
    """One `subscribe` call: its callbacks and how far it has been fed."""

    __slots__ = ("ended", "on_done", "on_text", "start")

    def __init__(
        self, on_text: Callable[[str], None], on_done: Callable[[GenerateResult], None]
    ) -> None:
        self.on_text, self.on_done = on_text, on_done
        self.start, self.ended = 0, False
