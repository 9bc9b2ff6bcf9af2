"""Request ids, access log lines and request metrics: one ASGI middleware, outermost.

Every response (errors, 413s from the body limit, 404s, streams) carries an
`X-Request-Id`: the client's own when it sent a usable one (printable, at most
`MAX_REQUEST_ID` characters of `[A-Za-z0-9._:/+=-]`), else a new random one. When the
response ends (just before its last byte, so a client holding the whole response
finds it logged and counted) one line is logged at INFO on the
`astrai.serve.access` logger (monitoring endpoints at DEBUG, so probes do not flood it)
in logfmt, ``key=value`` (values with spaces, quotes, `=` or control characters
JSON-quoted, so one request is always one line):

    request_id=... method=POST path=/v1/chat/completions status=200 protocol=openai_chat
    duration=0.153 client=127.0.0.1:50712 tokens_in=12 tokens_out=8 ttft=0.021
    finish=stop id=chatcmpl-...

`duration` and `ttft` are seconds (TTFT from submission to the first token, as this
request saw it); the token fields, `finish` and `id` (the response's own id) are present
when the request reached the engine. The same fields are attached to the log record as
`record.access` (a dict) for JSON formatters. The handler hands its request over by
setting `request.state.astrai_request` (a `protocol.RequestContext`).
"""

from __future__ import annotations

import json
import logging
import re
import time
import uuid
from typing import TYPE_CHECKING, Any

from astrai.serve.limits import ASGIApp, Message, Receive, Scope, Send
from astrai.serve.metrics import MONITORING_PATHS, HTTPMetrics, protocol_of

if TYPE_CHECKING:
    from astrai.serve.protocol import RequestContext

access_logger = logging.getLogger("astrai.serve.access")

HEADER = "x-request-id"
MAX_REQUEST_ID = 128
_VALID_ID = re.compile(rf"[A-Za-z0-9._:/+=-]{{1,{MAX_REQUEST_ID}}}")
_PLAIN = re.compile(r"[^\s\"=\\]+")


def request_id_from(headers: list[tuple[bytes, bytes]]) -> str:
    """The client's `X-Request-Id` if it is usable, else a new one (32 hex digits)."""
    for name, value in headers:
        if name.lower() == HEADER.encode():
            given = value.decode("latin-1").strip()
            if _VALID_ID.fullmatch(given):
                return given
            break
    return uuid.uuid4().hex


def logfmt(fields: dict[str, Any]) -> str:
    """`key=value ...`; values with spaces, quotes or `=` are JSON-quoted."""
    parts = []
    for key, value in fields.items():
        text = f"{value:.3f}" if isinstance(value, float) else str(value)
        if not _PLAIN.fullmatch(text):
            text = json.dumps(text, ensure_ascii=False)  # escapes newlines: one line
        parts.append(f"{key}={text}")
    return " ".join(parts)


def _engine_fields(ctx: RequestContext) -> dict[str, Any]:
    """What the handler knows of a request that reached the engine."""
    firsts = [c.result.task.first_token_at for c in ctx.choices]
    firsts = [t for t in firsts if t is not None]
    fields: dict[str, Any] = {
        "tokens_in": ctx.prompt_tokens,
        "tokens_out": ctx.completion_tokens,
    }
    if firsts:
        fields["ttft"] = min(firsts) - ctx.t0
    fields["finish"] = ",".join(c.finish_reason or "disconnected" for c in ctx.choices)
    fields["id"] = ctx.id
    return fields


class AccessLogMiddleware:
    """Adds `X-Request-Id`, logs one line per request and feeds `HTTPMetrics`."""

    def __init__(self, app: ASGIApp, metrics: HTTPMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        t0 = time.perf_counter()
        rid = request_id_from(scope.get("headers", []))
        scope.setdefault("state", {})["request_id"] = rid
        status = 500  # what the client gets if the app fails before answering
        logged = False

        def finish() -> None:
            nonlocal logged
            if not logged:
                logged = True
                self._record(scope, rid, status, time.perf_counter() - t0)

        async def send_with_id(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                headers = [
                    (k, v) for k, v in message.get("headers", []) if k.lower() != b"x-request-id"
                ]
                headers.append((HEADER.encode(), rid.encode()))
                message = {**message, "headers": headers}
            if message["type"] == "http.response.body" and not message.get("more_body", False):
                # Before the last byte leaves: a client that has the whole response sees
                # it counted and logged.
                finish()
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        finally:
            finish()  # the app ended without a final body (a crash, a client gone)

    def _record(self, scope: Scope, rid: str, status: int, seconds: float) -> None:
        path = scope.get("path", "")
        self.metrics.observe(path, status, seconds)
        client = scope.get("client")
        fields: dict[str, Any] = {
            "request_id": rid,
            "method": scope.get("method", ""),
            "path": path,
            "status": status,
            "protocol": protocol_of(path),
            "duration": seconds,
            "client": f"{client[0]}:{client[1]}" if client else "-",
        }
        ctx = scope.get("state", {}).get("astrai_request")
        if ctx is not None:
            fields.update(_engine_fields(ctx))
        level = logging.DEBUG if path in MONITORING_PATHS else logging.INFO
        access_logger.log(level, "%s", logfmt(fields), extra={"access": fields})
