"""What the RL routes put around every request: the `X-Policy-Version` header, and the
gate that holds generation while it is paused or while weights change.

`GenerationGate` counts the generation requests in flight (`/generate`, the OpenAI and
Anthropic routes; not `/v1/score`, which runs the reward model). `close()` (`/pause_generation`, and every weight update)
lets no new one in and waits until those in flight have finished, so a request runs
wholly on one policy version and the version `/generate` checked is the one it ran on.
Requests that arrive meanwhile wait, unread, and run after `open()`. After a weight
transfer that failed halfway the model holds a mix of two versions: `spoil()` answers
every generation request 503 until the next complete update (`restore()`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from astrai.serve.errors import APIError, error_body
from astrai.serve.limits import ASGIApp, Message, Receive, Scope, Send
from astrai.serve.protocol import SafeJSONResponse

POLICY_VERSION_HEADER = "x-policy-version"
GATED_PATHS = frozenset({"/generate", "/v1/chat/completions", "/v1/completions", "/v1/messages"})
SPOILED = (
    "a weight update failed halfway: the model holds a mix of two policy versions; "
    "generation resumes after the next complete update"
)


class GenerationGate:
    """Open / closed, and the generation requests in flight (on the event loop only)."""

    def __init__(self) -> None:
        self._open = asyncio.Event()
        self._open.set()
        self._idle = asyncio.Event()
        self._idle.set()
        self.inflight = 0
        self.waiting = 0  # requests held at the closed gate
        self.paused = False  # closed by /pause_generation (an update reopens only if not)
        self.spoiled = False

    async def enter(self) -> None:
        while not self._open.is_set():
            self.waiting += 1
            try:
                await self._open.wait()
            finally:
                self.waiting -= 1
        if self.spoiled:
            raise APIError(503, SPOILED, kind="overloaded", code="weights_inconsistent")
        self.inflight += 1
        self._idle.clear()

    def exit(self) -> None:
        self.inflight -= 1
        if self.inflight == 0:
            self._idle.set()

    async def close(self) -> None:
        """Let nothing new in; return when the requests in flight have finished."""
        self._open.clear()
        await self._idle.wait()

    def open(self) -> None:
        self._open.set()

    @property
    def is_open(self) -> bool:
        return self._open.is_set()

    def spoil(self) -> None:
        self.spoiled = True

    def restore(self) -> None:
        self.spoiled = False


class RLMiddleware:
    """Adds `X-Policy-Version: <version()>` to every response, and passes requests to
    `GATED_PATHS` through `gate` (a spoiled gate's 503 is answered here)."""

    def __init__(self, app: ASGIApp, gate: GenerationGate, version: Callable[[], int]) -> None:
        self.app = app
        self.gate = gate
        self.version = version

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def send_with_version(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = list(message.get("headers", []))
                headers.append((POLICY_VERSION_HEADER.encode(), str(self.version()).encode()))
                message = {**message, "headers": headers}
            await send(message)

        if scope.get("path") not in GATED_PATHS:
            await self.app(scope, receive, send_with_version)
            return
        try:
            await self.gate.enter()
        except APIError as err:
            response = SafeJSONResponse(
                error_body(scope.get("path", ""), err), status_code=err.status
            )
            await response(scope, receive, send_with_version)
            return
        try:
            await self.app(scope, receive, send_with_version)
        finally:
            self.gate.exit()
