"""The run loop of one request, the same for every protocol: `ProtocolHandler`.

It renders and tokenizes the request off the event loop (the builder's `prepare`), submits
each prompt's `n` choices as one engine group (`submit_group`: the prompt is prefilled
once) with the builder's `SamplingParams` (the engine checks them: its
refusals become the protocol's errors, `refusals.py`), merges their text streams on the
event loop, applies stop strings and tool-call parsing (`OutputParser`), cancels on a stop
string, a timeout or a client gone, and releases the request (its log line:
`astrai.serve.access`). A `ResponseBuilder` (`protocol.py`) only turns the events into
its protocol's JSON and SSE, so adding a protocol is one builder file.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections.abc import AsyncIterator, Iterable
from dataclasses import replace
from typing import Any

from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from astrai.inference import EngineNotReady, RequestRejected
from astrai.inference.adapters import AdapterNotFound
from astrai.serve.adapters import model_not_found
from astrai.serve.best_of import keep_best
from astrai.serve.errors import APIError
from astrai.serve.limits import check_prompt_chars, check_unicode
from astrai.serve.protocol import (
    Choice,
    Prepared,
    RequestContext,
    ResponseBuilder,
    SafeJSONResponse,
)
from astrai.serve.reasoning import ReasoningDelta, with_reasoning
from astrai.serve.refusals import bad_settings, ended, failed, refused
from astrai.serve.state import ServerState
from astrai.serve.tool_parsers import Event, OutputParser, TextDelta

logger = logging.getLogger("astrai.serve")


_REFUSED = ("rejected", "aborted")  # a task that ended like this at submission never ran


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
        """Resolve the model it names (a LoRA adapter, or the base; `adapters.py`), check
        the request's strings, then render and tokenize it off the event loop."""
        settings = self.state.settings
        adapter = self.state.models.resolve(body)  # an unknown model: 404 before any work
        check_unicode(body)
        check_prompt_chars(body, self.builder.prompt_fields, settings.max_prompt_chars)
        tokenizer = self.engine.tokenizer
        prepared = await self.state.run_blocking(self.builder.prepare, body, tokenizer, settings)
        if adapter is not None:  # the engine batches it with other adapters' requests
            prepared.params = replace(prepared.params, adapter=adapter)
            prepared.model = adapter  # responses name the model that answered
        return prepared

    async def count_tokens(self, body: Any) -> int:
        """Prompt tokens of `body`, exactly as `handle` would submit them (no generation)."""
        return sum(len(p) for p in (await self.prepare(body)).prompts)

    async def handle(self, body: Any, request: Request | None = None) -> Response:
        self.state.check_ready()
        prepared = await self.prepare(body)
        ctx = RequestContext(
            id=self.builder.id_prefix + secrets.token_hex(12),
            prepared=prepared,
            system_fingerprint=self.state.fingerprint(),
        )
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
            raise failed(ctx)
        keep_best(ctx)  # best_of > n: the n most likely of each prompt's samples
        try:
            return SafeJSONResponse(self.builder.format_response(ctx))
        except APIError:  # an output the protocol cannot carry (a NaN log-prob, logprobs.py)
            self.state.requests_failed += 1
            raise

    # ------------------------------------------------------------------ submission
    def _submit(self, ctx: RequestContext) -> None:
        p = ctx.prepared
        loop = asyncio.get_running_loop()
        post, put = self.engine.handoff.post, ctx.queue.put_nowait  # one wake-up per step
        tool_parser = self.state.tool_parser if p.parse_tools else None
        seed = p.params.seed
        if len(p.prompts) > 1:  # a batch: every prompt passes the check before any is queued
            for prompt, ids in enumerate(p.prompts):
                try:
                    self.engine.check_request(ids, p.params)
                except AdapterNotFound:  # unloaded since `prepare`
                    raise model_not_found(p.model) from None
                except RequestRejected as err:
                    raise refused(p, prompt, err.rejection) from None
                except (TypeError, ValueError) as err:
                    raise bad_settings(err) from err
        for prompt, ids in enumerate(p.prompts):
            first = prompt * p.samples  # choice `first + j` is sample j: seed `seed + first + j`
            params = replace(p.params, n=p.samples, seed=None if seed is None else seed + first)
            try:  # the engine's one request check: bad settings raise, naming the parameter
                results = self.engine.submit_group(ids, params=params)
            except EngineNotReady as err:
                self._cancel_all(ctx)
                raise APIError(503, str(err), kind="overloaded") from err
            except AdapterNotFound:  # unloaded since `prepare`
                self._cancel_all(ctx)
                raise model_not_found(p.model) from None
            except (TypeError, ValueError) as err:
                self._cancel_all(ctx)
                raise bad_settings(err) from err
            ended_early = [r for r in results if r.done and r.finish_reason in _REFUSED]
            if ended_early:
                for r in results:  # a group is refused whole; cancel any that was queued
                    if not r.done:
                        self.engine.cancel(r)
                self._cancel_all(ctx)
                raise ended(p, prompt, ended_early[0])
            for i, result in enumerate(results, start=first):
                prefix = self.builder.tool_id_prefix
                tools = None if tool_parser is None else tool_parser.new(p.tool_defs, prefix)
                parser = OutputParser(p.stops, tools)
                parser = with_reasoning(p.reasoning, parser)  # the reasoning is split off first
                ctx.choices.append(Choice(i, result, parser, prompt_index=prompt))
                # The engine's thread only wakes this loop (once per step); the text is
                # decoded here, by `_events`, off the scheduler's critical path.
                result.listen(lambda i=i: post(loop, put, i))
                put(i)  # whatever came before `listen`

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
            if isinstance(ev, TextDelta | ReasoningDelta):
                (choice.text if isinstance(ev, TextDelta) else choice.reasoning).append(ev.text)
                choice.chars += len(ev.text)
                if out and out[-1][0] is choice and type(out[-1][1]) is type(ev):
                    out[-1] = (choice, type(ev)(out[-1][1].text + ev.text))
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
        except APIError as err:  # an output the protocol cannot carry (a NaN log-prob)
            logger.warning("request %s: %s", ctx.id, err.message)
            self._cancel_all(ctx)
            yield "".join(b.format_stream_error(ctx, err))
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
