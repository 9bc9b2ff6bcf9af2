"""`GenerateResult`: one request's text as it is produced, for blocking, iterating or subscribing."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator

from astrai.inference.logprobs import TokenLogprob, TopLogprobs
from astrai.inference.task import Task
from astrai.tokenizer import AutoTokenizer


class GenerateResult:
    """Progress of one request, filled in by the engine's loop thread.

    Non-streaming callers block on `wait_completion`; streaming callers iterate, `wait` for
    new text, or `subscribe` callbacks (the HTTP server, async streams). The loop thread
    feeds it through `on_token` / `on_finish` (set as the task's callbacks).
    """

    def __init__(self, task: Task, tokenizer: AutoTokenizer) -> None:
        self.task = task
        self._decoder = tokenizer.stream_decoder(skip_special_tokens=True)
        self._pieces: list[str] = []
        self._read = 0
        self._cond = threading.Condition()
        self._event = threading.Event()
        self._done = False
        self._text_subscribers: list[Callable[[str], None]] = []
        self._done_subscribers: list[Callable[[GenerateResult], None]] = []

    # -- loop side
    def on_token(self, task: Task, token: int, logprob: float) -> None:
        self._push(self._decoder.step(token))

    def on_finish(self, task: Task) -> None:
        self._push(self._decoder.flush())
        # Subscribers run under the lock, so one subscribing concurrently sees each piece
        # exactly once: in its snapshot or as a call.
        with self._cond:
            self._done = True
            self._cond.notify_all()
            for cb in self._done_subscribers:
                cb(self)
        self._event.set()

    def _push(self, text: str) -> None:
        if not text:
            return
        with self._cond:
            self._pieces.append(text)
            self._cond.notify_all()
            for cb in self._text_subscribers:
                cb(text)
        self._event.set()

    # -- caller side
    def subscribe(
        self, on_text: Callable[[str], None], on_done: Callable[[GenerateResult], None]
    ) -> None:
        """Call `on_text` with every piece of text, in order, and `on_done` at the end.

        Text produced before the call is delivered at once (and the end, if it came), each
        piece exactly once. Callbacks run on the loop thread (or here, for earlier text)
        while the result's lock is held: keep them short and never block in them.
        """
        with self._cond:
            for text in self._pieces:
                on_text(text)
            if self._done:
                on_done(self)
                return
            self._text_subscribers.append(on_text)
            self._done_subscribers.append(on_done)

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

    @property
    def logprobs(self) -> list[float]:
        """Log-probs of the generated tokens (the request's `logprobs_mode`; raw by default)."""
        return list(self.task.logprobs)

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

    def wait(self, timeout: float | None = None) -> bool:
        """Block until new text or the end arrives; True if something did."""
        got = self._event.wait(timeout)
        self._event.clear()
        return got

    def wait_completion(self, timeout: float | None = None) -> str:
        """The whole text; raises ValueError if the request was rejected or aborted."""
        with self._cond:
            if not self._cond.wait_for(lambda: self._done, timeout):
                raise TimeoutError(f"request {self.id} did not finish within {timeout} s")
        self.raise_if_failed()
        return self.text

    def raise_if_failed(self) -> None:
        """Raise ValueError naming the reason if the request was rejected or aborted."""
        if self.task.finish_reason in ("rejected", "aborted"):
            raise ValueError(f"request {self.id} {self.task.finish_reason}: {self.task.error}")

    def __iter__(self) -> Iterator[str]:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._read < len(self._pieces) or self._done)
                pieces = self._pieces[self._read :]
                self._read = len(self._pieces)
                done = self._done
            yield from pieces
            if done and self._read == len(self._pieces):
                self.raise_if_failed()
                return
