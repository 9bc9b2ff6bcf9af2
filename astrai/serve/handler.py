"""Protocol-independent request handling: one `ProtocolHandler`, one builder per protocol.

The handler owns everything that must be identical for OpenAI and Anthropic: admission
(readiness, queue), submission of the `n` engine tasks, merging their text streams on the
event loop, stop strings and tool-call parsing (`OutputParser`), cancellation when a stop
string matches or the client goes away, and usage (its log line: `astrai.serve.access`). A
`ResponseBuilder` only turns the resulting events into its protocol's JSON and SSE, so
adding a protocol is one builder file.
"""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
import time
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from astrai.inference.engine import EngineNotReady, GenerateResult
from astrai.serve.errors import APIError
from astrai.serve.limits import check_prompt_chars, check_unicode
from astrai.serve.parsing import Event, OutputParser, TextDelta, ToolCall, ToolCallFormat
from astrai.serve.settings import ServeSettings

if TYPE_CHECKING:
    from astrai.inference import InferenceEngine
    from astrai.tokenizer import AutoTokenizer

logger = logging.getLogger("astrai.serve")

# Internal finish reasons (stop, stop_sequence, length, tool_calls, error); the builders map
# them to their protocol's names.


@dataclass
class Prepared:
    """A request reduced to what the engine and the parsers need.

    `prompts` holds one token list per prompt (chat: one; legacy completions: a batch);
    each is sampled `n` times, choice `index = prompt_index * n + j`. `prompt_param` is the
    request field an error about a prompt names; `options` is the builder's own (echo...).
    `max_tokens_param` is the field that set `max_tokens` explicitly (`max_tokens`,
    `max_completion_tokens`), held to the context by the server's `max_tokens_policy`;
    None: the protocol's default, which is capped to what fits after the prompt.
    """

    prompts: list[list[int]]
    max_tokens: int
    sampling: dict[str, Any]
    n: int = 1
    stops: list[str] = field(default_factory=list)
    parse_tools: bool = False
    stream: bool = False
    include_usage: bool = False
    model: str = "astrai"
    prompt_param: str = "messages"
    max_tokens_param: str | None = None
    options: dict[str, Any] = field(default_factory=dict)


@dataclass
class Choice:
    """Output of one engine task, as seen by the client.

    Token bookkeeping for log-probs: every text piece from the engine arrives with the
    number of output tokens it completes (`marks`: raw characters so far -> tokens so far),
    so a builder hands out the entries of the tokens whose text it has emitted (`chars`)
    and no others: text held back (a possible stop string) holds its tokens back too.
    `token_end` is where the reported tokens end: at the piece a stop string matched in, or
    at the last output token once the task is done. `tokens_sent` is the builder's cursor.
    """

    index: int
    result: GenerateResult
    parser: OutputParser
    prompt_index: int = 0
    text: list[str] = field(default_factory=list)
    tool_calls: list[ToolCall] = field(default_factory=list)
    finish_reason: str | None = None
    stop_sequence: str | None = None
    error: str | None = None
    chars: int = 0  # length of `content`
    marks: list[tuple[int, int]] = field(default_factory=list)
    token_end: int | None = None
    tokens_sent: int = 0
    taken: int = 0  # text pieces of `result` read so far (`GenerateResult.take`)
    ended: bool = False  # its end has been read
    _mark: int = 0  # marks before this one are covered by the text emitted so far
    _covered: int = 0

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def content(self) -> str:
        return "".join(self.text)

    @property
    def output_tokens(self) -> int:
        return len(self.result.task.output_ids)

    def received(self, text: str, tokens: int) -> None:
        """Record a raw text piece that completes the first `tokens` output tokens."""
        chars = self.marks[-1][0] + len(text) if self.marks else len(text)
        self.marks.append((chars, tokens))

    def tokens_emitted(self) -> int:
        """How many output tokens the text emitted so far fully covers (never decreases)."""
        while self._mark < len(self.marks) and self.marks[self._mark][0] <= self.chars:
            self._covered = self.marks[self._mark][1]
            self._mark += 1
        end = self.token_end
        return self._covered if end is None else min(self._covered, end)

    def take_tokens(self, upto: int | None = None) -> range:
        """Output positions not yet handed out, through `upto` (default: `token_end`)."""
        end = self.token_end if upto is None else upto
        end = max(self.tokens_sent, end if end is not None else self.tokens_sent)
        out = range(self.tokens_sent, end)
        self.tokens_sent = end
        return out


@dataclass(eq=False)
class RequestContext:
    """One HTTP request in flight; builders keep their own stream state in `extra`."""

    id: str
    prepared: Prepared
    t0: float = field(default_factory=time.perf_counter)
    created: int = field(default_factory=lambda: int(time.time()))
    choices: list[Choice] = field(default_factory=list)
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def model(self) -> str:
        return self.prepared.model

    @property
    def prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prepared.prompts)

    @property
    def completion_tokens(self) -> int:
        return sum(c.output_tokens for c in self.choices)

    @property
    def all_finished(self) -> bool:
        return all(c.finished for c in self.choices)

    @property
    def error(self) -> str | None:
        return next((c.error for c in self.choices if c.error), None)


class ResponseBuilder(ABC):
    """Formats one protocol: request -> `Prepared`, events -> SSE strings / JSON."""

    id_prefix: str = "req_"
    tool_id_prefix: str = "call_"
    # Request fields whose text is the prompt (the character limit); absent ones are skipped.
    prompt_fields: tuple[str, ...] = ("system", "messages", "prompt", "suffix")

    @abstractmethod
    def prepare(self, body: Any, tokenizer: AutoTokenizer, settings: ServeSettings) -> Prepared:
        """Validate beyond the schema and render the prompt; raise `APIError` (400)."""

    @abstractmethod
    def error_body(self, err: APIError) -> dict[str, Any]: ...

    @abstractmethod
    def format_stream_start(self, ctx: RequestContext) -> list[str]: ...

    @abstractmethod
    def format_chunk(self, ctx: RequestContext, choice: Choice, event: Event) -> list[str]: ...

    @abstractmethod
    def format_choice_end(self, ctx: RequestContext, choice: Choice) -> list[str]: ...

    @abstractmethod
    def format_stream_end(self, ctx: RequestContext) -> list[str]: ...

    @abstractmethod
    def format_stream_error(self, ctx: RequestContext, err: APIError) -> list[str]: ...

    @abstractmethod
    def format_response(self, ctx: RequestContext) -> dict[str, Any]: ...


class ServerState:
    """What the handlers share: admission, requests in flight, counters, shutdown."""

    def __init__(
        self,
        engine: InferenceEngine,
        settings: ServeSettings,
        tool_format: ToolCallFormat | None,
    ) -> None:
        self.engine = engine
        self.settings = settings
        self.tool_format = tool_format
        self.draining = False
        self.inflight: set[RequestContext] = set()
        self.requests_total = 0
        self.requests_failed = 0
        self.tokens_out = 0
        self.started = time.time()
        # Prompt rendering and tokenizing run here, so a large prompt never blocks the
        # event loop (other streams, /health); `tokenizers` releases the GIL while encoding.
        self.executor = ThreadPoolExecutor(
            max_workers=max(1, settings.tokenizer_threads), thread_name_prefix="astrai-tokenize"
        )

    async def run_blocking(self, fn: Callable[..., Any], *args: Any) -> Any:
        """`fn(*args)` on the tokenizer pool, awaited from the event loop."""
        return await asyncio.get_running_loop().run_in_executor(self.executor, fn, *args)

    def close(self) -> None:
        """Stop the tokenizer pool (idle threads; queued work is dropped)."""
        self.executor.shutdown(wait=False, cancel_futures=True)

    def check_ready(self) -> None:
        retry = {"retry-after": str(self.settings.retry_after_s)}
        if self.draining:
            raise APIError(503, "server is shutting down", kind="overloaded", headers=retry)
        if not self.engine.ready:
            raise APIError(503, "engine not ready", kind="overloaded", headers=retry)
        if self.engine.queue_full:
            raise APIError(
                503, "request queue is full, retry later", kind="overloaded", headers=retry
            )

    def begin_shutdown(self) -> None:
        """Refuse new requests and end every open one (streams finish cleanly)."""
        self.draining = True
        for ctx in list(self.inflight):
            for c in ctx.choices:
                if not c.result.done:
                    self.engine.cancel(c.result)

    def stats(self) -> dict[str, Any]:
        """HTTP-side counts (latencies: the engine's `get_stats()`, and `/metrics`)."""
        return {
            "requests_total": self.requests_total,
            "requests_failed": self.requests_failed,
            "requests_in_flight": len(self.inflight),
            "output_tokens": self.tokens_out,
            "draining": self.draining,
        }


class SafeJSONResponse(JSONResponse):
    """A JSONResponse that always encodes: a lone surrogate becomes '?' instead of a 500."""

    def render(self, content: Any) -> bytes:
        text = json.dumps(content, ensure_ascii=False, allow_nan=False, separators=(",", ":"))
        return text.encode("utf-8", "replace")


class _ClientGone(Exception):
    pass


class _TimedOut(Exception):
    pass


class ProtocolHandler:
    """Runs one request against the engine for any `ResponseBuilder`."""

    def __init__(self, state: ServerState, builder: ResponseBuilder) -> None:
        self.state = state
        self.engine = state.engine
        self.builder = builder

    # ------------------------------------------------------------------ entry point
    async def prepare(self, body: Any) -> Prepared:
        """Check the request's strings, then render and tokenize it off the event loop."""
        settings = self.state.settings
        check_unicode(body)
        check_prompt_chars(body, self.builder.prompt_fields, settings.max_prompt_chars)
        tokenizer = self.engine.tokenizer
        return await self.state.run_blocking(self.builder.prepare, body, tokenizer, settings)

    async def count_tokens(self, body: Any) -> int:
        """Prompt tokens of `body`, exactly as `handle` would submit them (no generation)."""
        return sum(len(p) for p in (await self.prepare(body)).prompts)

    async def handle(self, body: Any, request: Request | None = None) -> Response:
        self.state.check_ready()
        prepared = await self.prepare(body)
        self._check_limits(prepared)
        ctx = RequestContext(id=self.builder.id_prefix + secrets.token_hex(12), prepared=prepared)
        if request is not None:  # for the access log line (astrai.serve.access)
            request.state.astrai_request = ctx
        self._submit(ctx)
        self.state.inflight.add(ctx)
        self.state.requests_total += 1
        if prepared.stream:
            return StreamingResponse(
                self._stream(ctx),
                media_type="text/event-stream",
                headers={"cache-control": "no-cache", "x-accel-buffering": "no"},
            )
        timeout = self.state.settings.request_timeout_s
        if timeout is not None:
            ctx.extra["deadline"] = time.monotonic() + timeout
        try:
            async for _ in self._events(ctx, request):
                pass
        except _ClientGone:
            logger.info("request %s: client disconnected, cancelled", ctx.id)
            return Response(status_code=499)
        except _TimedOut:
            logger.warning("request %s: timed out after %ss, cancelled", ctx.id, timeout)
            raise APIError(
                504, f"request timed out after {timeout} s", kind="timeout", code="timeout"
            ) from None
        finally:
            self._release(ctx)  # also cancels the engine tasks still running
        if ctx.error is not None:
            rejected = any(c.result.finish_reason == "rejected" for c in ctx.choices)
            if rejected:  # e.g. a paged KV pool that can never hold this prompt
                raise APIError(400, ctx.error, param=prepared.prompt_param)
            raise APIError(500, ctx.error, kind="server")
        return SafeJSONResponse(self.builder.format_response(ctx))

    # ------------------------------------------------------------------ admission
    def _check_limits(self, p: Prepared) -> None:
        limit = self.engine.max_seq_len - 1
        if self.state.settings.max_prompt_tokens is not None:
            limit = min(limit, self.state.settings.max_prompt_tokens)
        vocab = self.engine.vocab_size
        for i, ids in enumerate(p.prompts):
            name = p.prompt_param if len(p.prompts) == 1 else f"{p.prompt_param}[{i}]"
            if len(ids) > limit:
                raise APIError(
                    400,
                    f"{name}: prompt is too long: {len(ids)} tokens, the limit is {limit}",
                    param=p.prompt_param,
                    code="context_length_exceeded",
                )
            if not ids:
                raise APIError(400, f"{name}: the prompt is empty", param=p.prompt_param)
            bad = [t for t in ids if not 0 <= t < vocab]
            if bad:
                raise APIError(
                    400,
                    f"{name}: token id(s) outside the vocabulary [0, {vocab}): {bad[:5]}",
                    param=p.prompt_param,
                )

    def _submit(self, ctx: RequestContext) -> None:
        p = ctx.prepared
        loop = asyncio.get_running_loop()
        post, put = self.engine.handoff.post, ctx.queue.put_nowait  # one wake-up per step
        fmt = self.state.tool_format if p.parse_tools else None
        # An explicit max_tokens is held to the context (the engine's rule, by the server's
        # policy); a default one is capped to what fits: the engine stops at a full context.
        explicit = p.max_tokens_param is not None
        policy = self.state.settings.max_tokens_policy if explicit else "clamp"
        for i in range(len(p.prompts) * p.n):
            sampling = dict(p.sampling)
            if sampling.get("seed") is not None:
                sampling["seed"] += i
            prompt = i // p.n
            try:  # the engine's one request check: bad settings raise, naming the parameter
                result = self.engine.submit(
                    p.prompts[prompt],
                    max_tokens=p.max_tokens,
                    max_tokens_policy=policy,
                    **sampling,
                )
            except EngineNotReady as err:
                self._cancel_all(ctx)
                raise APIError(503, str(err), kind="overloaded") from err
            except (TypeError, ValueError) as err:
                self._cancel_all(ctx)
                raise APIError(400, str(err), param=str(err).split(" ")[0].split("[")[0]) from err
            if result.done and result.finish_reason in ("rejected", "aborted"):
                self._cancel_all(ctx)
                raise self._rejected(p, prompt, result)
            parser = OutputParser(p.stops, fmt, self.builder.tool_id_prefix)
            ctx.choices.append(Choice(i, result, parser, prompt_index=prompt))
            # The engine's thread only wakes this loop (once per step); the text is decoded
            # here, by `_events`, off the scheduler's critical path.
            result.listen(lambda i=i: post(loop, put, i))
            put(i)  # whatever came before `listen`

    @staticmethod
    def _rejected(p: Prepared, prompt: int, result: GenerateResult) -> APIError:
        """The engine's refusal of a request as this protocol's error: 503 when it failed,
        else a 400 naming the field at fault (the prompt, or the max_tokens field the
        request spelled, with `context_length_exceeded`)."""
        task = result.task
        reason = task.error or "request rejected"
        if result.finish_reason != "rejected":
            return APIError(503, reason, kind="overloaded")
        if task.error_param != "max_tokens":
            return APIError(400, reason, param=p.prompt_param)
        field = p.max_tokens_param or "max_tokens"
        where = f"{p.prompt_param}[{prompt}]: " if len(p.prompts) > 1 else ""
        return APIError(
            400, f"{field}: {where}{reason}", param=field, code="context_length_exceeded"
        )

    def _cancel_all(self, ctx: RequestContext) -> None:
        for c in ctx.choices:
            if not c.result.done:
                self.engine.cancel(c.result)

    # ------------------------------------------------------------------ the event stream
    async def _next(self, ctx: RequestContext, request: Request | None) -> int:
        if request is None:  # streaming: Starlette cancels the response on disconnect
            return await ctx.queue.get()
        poll = self.state.settings.disconnect_poll_s
        # The deadline is checked here rather than by cancelling the task: in Python 3.11
        # `wait_for` can swallow a cancellation that races a completed get.
        deadline = ctx.extra.get("deadline")
        while True:  # plain: poll, also while tokens keep arriving
            now = time.monotonic()
            wait = poll
            if deadline is not None:
                if now >= deadline:
                    raise _TimedOut
                wait = min(poll, deadline - now)
            last = ctx.extra.setdefault("checked", now)
            if now - last >= poll:
                ctx.extra["checked"] = now
                if await request.is_disconnected():
                    raise _ClientGone
            try:
                return await asyncio.wait_for(ctx.queue.get(), wait)
            except TimeoutError:
                continue

    async def _events(
        self, ctx: RequestContext, request: Request | None = None
    ) -> AsyncIterator[list[tuple[Choice, Event | None]]]:
        """Batches of (choice, event); event None marks the end of that choice.

        Everything already queued is taken at once and consecutive text of a choice is
        merged, so a loaded server sends fewer, larger chunks instead of falling behind.
        """
        pending = len(ctx.choices)
        while pending:
            woken = [await self._next(ctx, request)]
            while not ctx.queue.empty():
                woken.append(ctx.queue.get_nowait())
            out: list[tuple[Choice, Event | None]] = []
            for i, text, tokens in self._take(ctx, dict.fromkeys(woken)):
                choice = ctx.choices[i]
                if choice.finished:
                    continue
                if text is None:
                    if choice.token_end is None:
                        choice.token_end = tokens
                    self._emit(out, choice, choice.parser.flush())
                    self._finish(choice)
                    out.append((choice, None))
                    pending -= 1
                    continue
                choice.received(text, tokens)
                stopped = choice.parser.matched_stop is not None
                events = choice.parser.feed(text)
                if not stopped and choice.parser.matched_stop is not None:
                    choice.token_end = tokens  # the stop string ends in this piece's tokens
                    if not choice.result.done:
                        self.engine.cancel(choice.result)
                self._emit(out, choice, events)
            if out:
                yield out

    @staticmethod
    def _take(ctx: RequestContext, woken: Iterable[int]) -> list[tuple[int, str | None, int]]:
        """The new text of the woken choices, decoded here: `(index, text, tokens)`, each
        piece with the output tokens that exist once it is complete, and `(index, None,
        tokens)` at a choice's end."""
        items: list[tuple[int, str | None, int]] = []
        for i in woken:
            choice = ctx.choices[i]
            pieces, choice.taken, done = choice.result.take(choice.taken)
            items += [(i, text, tokens) for text, tokens in pieces]
            if done and not choice.ended:
                choice.ended = True
                items.append((i, None, len(choice.result.task.output_ids)))
        return items

    @staticmethod
    def _emit(out: list[tuple[Choice, Event | None]], choice: Choice, events: list[Event]) -> None:
        for ev in events:
            if isinstance(ev, TextDelta):
                choice.text.append(ev.text)
                choice.chars += len(ev.text)
                if out and out[-1][0] is choice and isinstance(out[-1][1], TextDelta):
                    out[-1] = (choice, TextDelta(out[-1][1].text + ev.text))
                    continue
            else:
                choice.tool_calls.append(ev)
            out.append((choice, ev))

    def _finish(self, choice: Choice) -> None:
        task = choice.result.task
        if task.finish_reason in ("rejected", "aborted"):
            choice.error = task.error or f"request {task.finish_reason}"
            choice.finish_reason = "error"
            return
        if choice.parser.matched_stop is not None:
            choice.finish_reason = "stop_sequence"
            choice.stop_sequence = choice.parser.matched_stop
        elif task.finish_reason == "stop":
            choice.finish_reason = "stop"
        else:  # length, or cancelled by a server shutdown: the output was cut short
            choice.finish_reason = "length"
        if choice.tool_calls and choice.finish_reason in ("stop", "stop_sequence"):
            choice.finish_reason = "tool_calls"

    async def _stream(self, ctx: RequestContext) -> AsyncIterator[bytes]:
        async for text in self._stream_text(ctx):
            yield text.encode("utf-8", "replace")  # never cut a stream on an unencodable str

    async def _stream_text(self, ctx: RequestContext) -> AsyncIterator[str]:
        b = self.builder
        try:
            yield "".join(b.format_stream_start(ctx))
            async for batch in self._events(ctx):
                parts: list[str] = []
                for choice, ev in batch:
                    if ev is None:
                        if choice.error is None:
                            parts += b.format_choice_end(ctx, choice)
                    else:
                        parts += b.format_chunk(ctx, choice, ev)
                if parts:
                    yield "".join(parts)
            if ctx.error is not None:
                yield "".join(b.format_stream_error(ctx, APIError(500, ctx.error, kind="server")))
            else:
                yield "".join(b.format_stream_end(ctx))
        finally:  # also on client disconnect (the response task is cancelled)
            self._release(ctx)

    # ------------------------------------------------------------------ bookkeeping
    def _release(self, ctx: RequestContext) -> None:
        if ctx not in self.state.inflight:
            return
        self.state.inflight.discard(ctx)
        self._cancel_all(ctx)
        done = ctx.all_finished
        if ctx.error is not None or not done:
            self.state.requests_failed += 1
        self.state.tokens_out += ctx.completion_tokens
        # The request's log line is the access log's (astrai.serve.access), at its end.


def sse(data: Any, event: str | None = None) -> str:
    """One SSE event; every event ends with a blank line."""
    payload = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)
    if event is None:
        return f"data: {payload}\n\n"
    return f"event: {event}\ndata: {payload}\n\n"
