"""Input limits applied before a request costs anything: body size, surrogates, prompt size.

The body limit is an ASGI middleware, so an oversized body is refused while it streams in
(by its Content-Length, or by counting the chunks of a chunked one) and is never held in
memory whole, parsed, or tokenized. The string checks run on the parsed request before
the prompt is rendered: a lone surrogate cannot be tokenized or encoded into a response,
and the character limit bounds the tokenizer's work per request.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Awaitable, Callable, Iterator, MutableMapping
from typing import Any

from pydantic import BaseModel

from astrai.serve.errors import APIError, error_body

logger = logging.getLogger("astrai.serve")

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

# How much of an oversized body is read (and thrown away) before answering, so that a
# client that sends its whole body before reading gets the 413 instead of a reset.
DRAIN_LIMIT = 256 * 1024 * 1024


def too_large(limit: int) -> APIError:
    """The 413 for a body over `limit` bytes (shaped per protocol by `error_body`)."""
    return APIError(
        413,
        f"request body is too large: the limit is {limit} bytes",
        kind="too_large",
        code="request_too_large",
    )


class BodyLimitMiddleware:
    """Refuse request bodies over `max_bytes` with a 413 in the protocol's error shape.

    The body is buffered up to the limit and replayed to the app, so the app never sees a
    partial body; the replayed `receive` still reports a later client disconnect.
    """

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] in ("GET", "HEAD", "OPTIONS"):
            await self.app(scope, receive, send)
            return
        declared = _content_length(scope)
        if declared is not None and declared > self.max_bytes:
            await _drain(receive, 0)
            await self._refuse(scope, send)
            return
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client left: let the app see it
                first: Message | None = message
                break
            body = message.get("body", b"")
            size += len(body)
            if size > self.max_bytes:
                if message.get("more_body", False):
                    await _drain(receive, size)
                await self._refuse(scope, send)
                return
            chunks.append(body)
            if not message.get("more_body", False):
                first = {"type": "http.request", "body": b"".join(chunks), "more_body": False}
                break
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                assert first is not None
                return first
            return await receive()

        await self.app(scope, replay, send)

    async def _refuse(self, scope: Scope, send: Send) -> None:
        logger.warning(
            "%s %s -> 413: body over %d bytes", scope["method"], scope["path"], self.max_bytes
        )
        body = json.dumps(error_body(scope["path"], too_large(self.max_bytes))).encode()
        headers = [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
            (b"connection", b"close"),
        ]
        await send({"type": "http.response.start", "status": 413, "headers": headers})
        await send({"type": "http.response.body", "body": body})


def _content_length(scope: Scope) -> int | None:
    for name, value in scope.get("headers", ()):
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None
    return None


async def _drain(receive: Receive, seen: int) -> None:
    """Read and discard the rest of a refused body (bounded by `DRAIN_LIMIT`)."""
    while seen <= DRAIN_LIMIT:
        message = await receive()
        if message["type"] != "http.request":
            return
        seen += len(message.get("body", b""))
        if not message.get("more_body", False):
            return


# --------------------------------------------------------------------------- strings


def _walk(value: Any, path: str, keys: bool = True) -> Iterator[tuple[str, str]]:
    """(dotted path, string) for every string in `value`; dict keys too when `keys`."""
    if isinstance(value, str):
        yield path, value
    elif isinstance(value, dict):
        for k, v in value.items():
            sub = f"{path}.{k}" if path else str(k)
            if keys and isinstance(k, str):
                yield sub, k
            yield from _walk(v, sub, keys)
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            yield from _walk(v, f"{path}.{i}" if path else str(i), keys)


def _dump(body: Any) -> Any:
    return body.model_dump(exclude_unset=True) if isinstance(body, BaseModel) else body


def check_unicode(body: Any) -> None:
    """400 naming the first field that holds a lone surrogate (not valid Unicode text)."""
    for path, text in _walk(_dump(body), ""):
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:
            path = path.encode("utf-8", "replace").decode()  # a key may be the culprit
            raise APIError(
                400, f"{path}: the string is not valid Unicode (lone surrogate)", param=path
            ) from None


def check_prompt_chars(body: Any, fields: tuple[str, ...], limit: int | None) -> None:
    """400 when the prompt's text (the strings under `fields`) exceeds `limit` characters;
    names the largest field. Checked before any tokenizing."""
    if limit is None:
        return
    data = _dump(body)
    sizes = {
        f: sum(len(s) for _, s in _walk(data.get(f), f, keys=False)) for f in fields if f in data
    }
    total = sum(sizes.values())
    if total > limit:
        field = max(sizes, key=lambda f: sizes[f])
        raise APIError(
            400,
            f"{field}: the prompt is too long: {total} characters, the limit is {limit}",
            param=field,
            code="context_length_exceeded",
        )
